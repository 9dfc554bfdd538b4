#!/usr/bin/env python3
"""Time to first token of a generation whose prompt starts with a long shared prefix (a
system prompt, few-shot examples): from a PrefixPool that holds the prefix, against the
same call with an empty pool (the whole prompt computed) and a plain stream, in one run.

Every run's prompt is the --prefix tokens followed by --suffix tokens of its own (fixed
seeded token ids: the compute does not depend on what the ids are). The three ways
alternate run by run; reported are the medians over --repeat runs of the seconds from
the call to the first token, and the prompt tokens the pool supplied. The ways must
generate the same --new-tokens greedy tokens.

    python tools/bench/prefix_pool.py --threads 2 --prefix 512 --repeat 7 --json prefix_pool.json
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


def first_token(model, prompt, args, pool=None) -> tuple:
    """(seconds to the first token, the tokens, cached prompt tokens) of one greedy stream."""
    options = dict(max_tokens=args.new_tokens, temperature=0.0, eos=False)
    if pool is not None:
        options["pool"] = pool
    t0 = time.perf_counter()
    with model.stream(prompt, **options) as stream:
        tokens = [next(stream)]
        seconds = time.perf_counter() - t0
        tokens += list(stream)
        return seconds, tokens, stream.result.cached_tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the packaged default model")
    ap.add_argument("--prefix", type=int, default=512, help="shared prefix tokens")
    ap.add_argument("--suffix", type=int, default=16, help="tokens of each run's own")
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args()
    path = args.model or str(default_model_path())
    with tinyloop.Model(path, device=args.device, threads=args.threads) as model:
        vocab = model.info.vocab_size
        rng = np.random.default_rng(0)
        prefix = rng.integers(0, vocab, args.prefix).tolist()
        with tinyloop.PrefixPool(model, max_bytes=0) as pool, tinyloop.PrefixPool(model) as empty:
            pool.add(prefix)
            ways = {"pool": pool, "empty pool": empty, "plain": None}
            runs = {name: [] for name in ways}
            first_token(model, prefix + rng.integers(0, vocab, args.suffix).tolist(), args)   # warm-up
            for _ in range(args.repeat):
                prompt = prefix + rng.integers(0, vocab, args.suffix).tolist()
                for name, way in ways.items():
                    runs[name].append(first_token(model, prompt, args, way))
                if len({tuple(runs[name][-1][1]) for name in ways}) != 1:
                    raise SystemExit("the pool's tokens differ from the whole prompt's")
            bytes_held = pool.stats()["bytes"]
        device = model.info.device_name
    res = {"model": Path(path).name, "machine": platform.processor() or platform.machine(), "device": device,
           "threads": args.threads, "prefix": args.prefix, "suffix": args.suffix, "repeat": args.repeat,
           "prefix_bytes": bytes_held, "rows": []}
    base = statistics.median(r[0] for r in runs["empty pool"])
    print(f"time to first token, {args.prefix}-token shared prefix + {args.suffix} own tokens, {res['model']} "
          f"on {device}, threads {args.threads}, median of {args.repeat} (prefix cache {bytes_held / 2**20:.1f} MiB)")
    for name, r in runs.items():
        ttft = statistics.median(x[0] for x in r)
        row = {"way": name, "ttft_ms": ttft * 1000, "speedup": base / ttft, "cached_tokens": r[0][2]}
        res["rows"].append(row)
        print(f"  {name:10s} {row['ttft_ms']:8.1f} ms  x{row['speedup']:.2f}  cached prompt tokens {row['cached_tokens']}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

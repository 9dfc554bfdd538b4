#!/usr/bin/env python3
"""What reporting log-probabilities and adjusting logits cost a generation: greedy decode
tokens/s with logprobs (the token's own, then with 5 alternatives), with a logit_bias and
with presence / frequency penalties, against plain greedy decoding of the same prompt in
the same run. Each of them brings every step's logits to the host and picks the token
there (docs/api.md, "Log-probabilities"), which on CUDA also leaves the recorded decode
graphs' device argmax for a logits download per step.

The ways alternate run by run; reported are the medians over --repeat runs. The ways
that change nothing about the tokens (logprobs) must give plain decoding's tokens.

    python tools/bench/logprobs.py --threads 2 --new-tokens 128 --repeat 5 --json logprobs.json
"""
import argparse
import json
import statistics
from pathlib import Path

import tinyloop
from tinyloop.default_model import default_model_path

WAYS = {
    "plain": {},
    "logprobs": dict(logprobs=True),
    "logprobs, top 5": dict(logprobs=True, top_logprobs=5),
    "logit_bias (3 tokens)": dict(logit_bias={0: -5.0, 1: 2.0, 2: 1.0}),
    "presence 0.5, frequency 0.5": dict(presence_penalty=0.5, frequency_penalty=0.5),
}
SAME_TOKENS = ("logprobs", "logprobs, top 5")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the packaged default model")
    ap.add_argument("--prompt", default="The history of the United States began")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    path = args.model or str(default_model_path())
    with tinyloop.Model(path, device=args.device, threads=args.threads) as model:
        options = dict(max_tokens=args.new_tokens, temperature=0.0, eos=False)
        model.generate(args.prompt, **options)   # warm-up (CUDA graphs, caches)
        speed = {name: [] for name in WAYS}
        for _ in range(args.repeat):
            tokens = {}
            for name, extra in WAYS.items():
                result = model.generate(args.prompt, **options, **extra)
                speed[name].append(result.decode_tokens_per_s)
                tokens[name] = result.tokens
            if any(tokens[name] != tokens["plain"] for name in SAME_TOKENS):
                raise SystemExit("logprobs changed the tokens")
        device = model.info.device_name
    plain = statistics.median(speed["plain"])
    rows = [dict(way=name, decode_tokens_per_s=round(statistics.median(s), 1),
                 vs_plain=round(statistics.median(s) / plain, 3)) for name, s in speed.items()]
    print(f"{Path(path).name} on {device}, threads {args.threads}, {args.new_tokens} greedy tokens, "
          f"median of {args.repeat}")
    for row in rows:
        print(f"  {row['way']:<30} {row['decode_tokens_per_s']:>9.1f} tok/s  x{row['vs_plain']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=Path(path).name, device=device, threads=args.threads,
                           new_tokens=args.new_tokens, repeat=args.repeat, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

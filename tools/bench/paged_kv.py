#!/usr/bin/env python3
"""Paged KV (kv_page_size) against the contiguous cache on the shipped model.

Speed: greedy generations of --new-tokens tokens after a prompt of --prompt-tokens
tokens, alternating the two sides round by round (timings on a shared machine drift by
10-20%); reported: the median prefill and decode tokens per second of --repeat rounds.
The two sides' tokens must be equal.

Memory: one context holds a prompt of --fork-prompt tokens, --forks forks of it each
decode --fork-tokens tokens of their own (different tokens per fork); reported: the
memory report's KV bytes with every context alive, paged against contiguous, and the
pages in use. A contiguous cache is counted at its allocation (max_seq_len x every slot;
on the CPU its untouched pages are not resident, see docs/cpu-backend.md); a page is
counted once however many contexts share it.

    python tools/bench/paged_kv.py --threads 2 [--device cuda] [--json out.json]
"""

import argparse
import datetime
import json
import platform
import statistics

import numpy as np

import tinyloop
from tinyloop.default_model import default_model_path


def tokens_of(model, n: int, seed: int) -> list:
    return [int(t) for t in np.random.default_rng(seed).integers(10, model.info.vocab_size, n)]


def speed(args, models: dict) -> dict:
    prompt = tokens_of(models["contiguous"], args.prompt_tokens, 1)
    runs = {name: {"prefill": [], "decode": []} for name in models}
    outputs = {}
    for _ in range(args.repeat):
        for name, model in models.items():
            r = model.generate(prompt, max_tokens=args.new_tokens, temperature=0.0, eos=False)
            assert len(r.tokens) == args.new_tokens, (name, r.stop_reason)
            runs[name]["prefill"].append(args.prompt_tokens / r.prefill_seconds)
            runs[name]["decode"].append(len(r.tokens) / r.decode_seconds)
            outputs.setdefault(name, r.tokens)
    tokens = list(outputs.values())
    assert all(t == tokens[0] for t in tokens), "paged and contiguous generations differ"
    return {name: {k: statistics.median(v) for k, v in r.items()} for name, r in runs.items()}


def memory(args, model) -> dict:
    prompt = tokens_of(model, args.fork_prompt, 2)
    before = model.memory_report()
    with model.context() as ctx:
        ctx.append(prompt)
        forks = [ctx.fork() for _ in range(args.forks)]
        for i, f in enumerate(forks):
            for t in tokens_of(model, args.fork_tokens, 100 + i):
                f.append([t])
        report = model.memory_report()
        for f in forks:
            f.close()
    return {"kv_cache_bytes": report["kv_cache_bytes"] - before["kv_cache_bytes"],
            "kv_pages_in_use": report["kv_pages_in_use"] - before["kv_pages_in_use"],
            "total_bytes": report["total_bytes"] - before["total_bytes"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--forks", type=int, default=8)
    ap.add_argument("--fork-prompt", type=int, default=512)
    ap.add_argument("--fork-tokens", type=int, default=64)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    path = default_model_path()
    sides = {"contiguous": 0, f"paged {args.page_size}": args.page_size}
    models = {name: tinyloop.Model(path, device=args.device, threads=args.threads, kv_page_size=p)
              for name, p in sides.items()}
    try:
        info = models["contiguous"].info
        print(f"{path.name} on {info.device_name}, {args.threads} threads, "
              f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
        rates = speed(args, models)
        for name, r in rates.items():
            print(f"{name:14s} prefill {r['prefill']:8.1f} tok/s   decode {r['decode']:7.2f} tok/s   "
                  f"(median of {args.repeat}, prompt {args.prompt_tokens}, {args.new_tokens} new)")
        mem = {name: memory(args, model) for name, model in models.items()}
        for name, m in mem.items():
            pages = f", {m['kv_pages_in_use']} pages" if m["kv_pages_in_use"] else ""
            print(f"{name:14s} {args.forks} forks of {args.fork_prompt} tokens + {args.fork_tokens} each: "
                  f"KV {m['kv_cache_bytes'] / 2**20:8.1f} MiB{pages}")
    finally:
        for model in models.values():
            model.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": platform.processor() or platform.machine(),
                       "device": info.device_name, "speed": rates, "memory": mem}, f, indent=2)


if __name__ == "__main__":
    main()

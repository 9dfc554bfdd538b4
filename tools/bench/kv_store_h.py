#!/usr/bin/env python3
"""Memory and speed of the store_h KV policy beside the exact per-step KV cache.

store_h (docs/model.md, "The store_h KV policy") keeps each core block's input per loop
iteration (d_model floats) instead of its K/V (2 x n_kv_head x head_dim) and recomputes
the K/V of earlier positions whenever a block attends. For each model (--models: the
packaged default model, and/or a random model shaped like Huginn-0125 at r = 32 with a
small width) and each context length (--prompt-tokens), a prompt of random tokens is
appended in one call and --new-tokens tokens are then decoded greedily one call each,
under both policies. Reported: the KV bytes per token a context holds (from the memory
report), prefill and decode speed, and the agreement of the two (the largest log-prob
difference over the decoded steps and whether the greedy tokens are the same).

    python tools/bench/kv_store_h.py --threads 2 --json kv_store_h.json
"""
import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

import tinyloop
from tinyloop.default_model import default_model_path
from tinyloop.fileformat.random_model import make_random_model

# Huginn-0125's loop (2 prelude, 4 core, 2 coda blocks, sandwich norms, concat injection
# from a noise state, MHA) at r = 32, narrow enough to run on a laptop core
HUGINN_R32 = dict(seed=5, vocab_size=1024, d_model=256, n_head=4, n_kv_head=4, head_dim=64, ffn_dim=512,
                  n_pre=2, n_core=4, n_post=2, default_depth=32, max_depth=32, max_seq_len=4096,
                  norm_placement="sandwich_outer", injection="concat", state_init="noise", noise_sigma=1.0)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    top = x.max()
    return x - top - np.log(np.exp(x - top).sum())


def run(model, prompt, new_tokens, depth, policy) -> dict:
    """The prompt in one call, then greedy decoding one token per call."""
    before = model.memory_report()["kv_cache_bytes"]
    n = len(prompt) + new_tokens
    with model.context(max_seq_len=n, max_depth=depth, kv_policy=policy) as ctx:
        kv_bytes = model.memory_report()["kv_cache_bytes"] - before
        t0 = time.perf_counter()
        logits = ctx.append(prompt, depth=depth)
        prefill = time.perf_counter() - t0
        rows, tokens = [log_softmax(logits)], []
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            tokens.append(int(np.argmax(logits)))
            logits = ctx.append([tokens[-1]])
            rows.append(log_softmax(logits))
        decode = time.perf_counter() - t0
    return dict(kv_bytes_per_token=kv_bytes / n, prefill_tok_s=len(prompt) / prefill,
                decode_tok_s=new_tokens / decode, tokens=tokens, logprobs=np.array(rows))


def bench_model(label, path, depth, prompt_lengths, new_tokens, threads) -> list:
    rows = []
    with tinyloop.Model(path, threads=threads) as model:
        info = model.info
        depth = depth or info.default_depth
        rng = np.random.default_rng(0)
        for n_prompt in prompt_lengths:
            prompt = rng.integers(0, info.vocab_size, n_prompt).astype(np.int32)
            exact = run(model, prompt, new_tokens, depth, "exact")
            store_h = run(model, prompt, new_tokens, depth, "store_h")
            diff = float(np.abs(exact["logprobs"] - store_h["logprobs"]).max())
            rows.append(dict(model=label, depth=depth, prompt_tokens=n_prompt, new_tokens=new_tokens,
                             d_model=info.d_model, kv_dim=info.n_kv_head * info.head_dim,
                             exact=dict((k, v) for k, v in exact.items() if k not in ("tokens", "logprobs")),
                             store_h=dict((k, v) for k, v in store_h.items() if k not in ("tokens", "logprobs")),
                             kv_share_of_exact=store_h["kv_bytes_per_token"] / exact["kv_bytes_per_token"],
                             max_logprob_diff=diff, same_greedy_tokens=exact["tokens"] == store_h["tokens"]))
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="default,huginn-r32", help="default, huginn-r32, or a .tinyloop path")
    ap.add_argument("--prompt-tokens", default="32,256", help="context lengths (comma-separated)")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--depth", type=int, default=0, help="0: each model's default depth")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    lengths = [int(n) for n in args.prompt_tokens.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            if name == "default":
                path = str(default_model_path())
            elif name == "huginn-r32":
                path = str(Path(tmp) / "huginn-r32.tinyloop")
                make_random_model(path, **HUGINN_R32)
            else:
                path = name
            rows += bench_model(name if name in ("default", "huginn-r32") else Path(name).name, path, args.depth,
                                lengths, args.new_tokens, args.threads)
    report = dict(threads=args.threads, machine=platform.processor() or platform.machine(), rows=rows)
    print("| model | depth | context | KV KiB/token exact | store_h | share | prefill tok/s exact | store_h "
          "| decode tok/s exact | store_h | max |dlogp| | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        e, s = r["exact"], r["store_h"]
        print(f"| {r['model']} | {r['depth']} | {r['prompt_tokens']} + {r['new_tokens']} | "
              f"{e['kv_bytes_per_token'] / 1024:.1f} | {s['kv_bytes_per_token'] / 1024:.1f} | "
              f"{r['kv_share_of_exact']:.2f} | {e['prefill_tok_s']:.1f} | {s['prefill_tok_s']:.1f} | "
              f"{e['decode_tok_s']:.2f} | {s['decode_tok_s']:.2f} | {r['max_logprob_diff']:.1e} | "
              f"{'yes' if r['same_greedy_tokens'] else 'no'} |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()

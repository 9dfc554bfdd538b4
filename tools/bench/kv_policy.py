#!/usr/bin/env python3
"""What the approximate KV policies cost on real text, used as generation uses them.

A fixed English text (--text, default the Gettysburg Address of tests/data) is tokenized
with the model's tokenizer; its first --prompt-tokens tokens are a prompt, appended in one
call, and every later token is then appended one at a time, as decoding appends it. Each
decoded token is scored from the logits before it, and the perplexity of those tokens is
reported for each policy (--policies: exact, share_last, ring:N) beside exact, with the
share of positions whose most likely token is exact's, the KV bytes per position the
policy's context holds (sized for the text and the depth, from the memory report) and the
decode speed. The exact policy's decoded log-probs are checked against one full-sequence
score (they must agree up to float rounding).

    python tools/bench/kv_policy.py --threads 2 --json kv_policy.json
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


def log_prob(logits: np.ndarray, token: int) -> float:
    x = logits.astype(np.float64)
    top = x.max()
    return float(x[token] - top - math.log(np.exp(x - top).sum()))


def parse_policy(text: str) -> tuple:
    """"exact" | "share_last" | "ring:N" -> (label, Model.context keyword arguments)."""
    if text.startswith("ring:"):
        return f"ring {int(text[5:])}", dict(kv_policy="ring", kv_ring_slots=int(text[5:]))
    if text in ("exact", "share_last"):
        return text, dict(kv_policy=text)
    raise SystemExit(f"unknown policy {text!r} (exact, share_last, ring:N)")


def decode_pass(model, ids, prompt_tokens, depth, options) -> dict:
    """The prompt in one call, then one call per token: the decoded tokens' log-probs and
    argmaxes, the context's KV bytes and the decode seconds."""
    before = model.memory_report()["kv_cache_bytes"]
    with model.context(max_seq_len=len(ids), max_depth=depth, **options) as ctx:
        kv_bytes = model.memory_report()["kv_cache_bytes"] - before
        logits = ctx.append(ids[:prompt_tokens], depth=depth)
        logprobs, argmax = [], []
        t0 = time.perf_counter()
        for i in range(prompt_tokens, len(ids)):
            logprobs.append(log_prob(logits, ids[i]))
            argmax.append(int(np.argmax(logits)))
            if i + 1 < len(ids):
                logits = ctx.append(ids[i:i + 1])
        seconds = time.perf_counter() - t0
    return dict(logprobs=np.array(logprobs), argmax=np.array(argmax), kv_bytes=kv_bytes,
                kv_bytes_per_token=kv_bytes / len(ids), seconds=seconds)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the packaged default model")
    ap.add_argument("--text", default=str(REPO / "tests" / "data" / "gettysburg.txt"))
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--depth", type=int, default=0, help="0: the model's default depth")
    ap.add_argument("--policies", default="exact,share_last,ring:2,ring:4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    path = args.model or str(default_model_path())
    policies = [parse_policy(p) for p in args.policies.split(",")]
    if policies[0][0] != "exact":
        policies.insert(0, parse_policy("exact"))
    with tinyloop.Model(path, threads=args.threads) as model:
        ids = np.asarray(model.tokenizer.encode(Path(args.text).read_text()), dtype=np.int32)
        if len(ids) <= args.prompt_tokens + 1:
            raise SystemExit(f"{args.text} holds {len(ids)} tokens, not more than the prompt's {args.prompt_tokens}")
        depth = args.depth or model.info.default_depth
        runs = {label: decode_pass(model, ids, args.prompt_tokens, depth, options) for label, options in policies}
        one_pass = model.score(ids, depth=depth)[args.prompt_tokens - 1:]
    exact = runs["exact"]
    check = float(np.abs(exact["logprobs"] - one_pass).max())
    if check > 1e-3:
        raise SystemExit(f"exact decoding differs from one full-sequence score by {check:.3g}")
    rows = []
    for label, run in runs.items():
        rows.append(dict(policy=label, perplexity=math.exp(-run["logprobs"].mean()),
                         mean_nll_increase=float(exact["logprobs"].mean() - run["logprobs"].mean()),
                         top1_same_as_exact=float((run["argmax"] == exact["argmax"]).mean()),
                         kv_bytes_per_token=run["kv_bytes_per_token"],
                         kv_share_of_exact=run["kv_bytes"] / exact["kv_bytes"],
                         decode_tok_s=len(run["logprobs"]) / run["seconds"]))
    report = dict(model=Path(path).name, text=Path(args.text).name, tokens=int(len(ids)),
                  prompt_tokens=args.prompt_tokens, decoded_tokens=int(len(exact["logprobs"])),
                  depth=depth, threads=args.threads, machine=platform.processor() or platform.machine(),
                  exact_vs_one_pass_max_diff=check, rows=rows)
    print(f"{report['model']}, depth {depth}: {report['text']} ({len(ids)} tokens), a {args.prompt_tokens}-token "
          f"prompt in one call, {report['decoded_tokens']} decoded tokens scored")
    print("| policy | perplexity | mean NLL increase | top-1 = exact's | KV bytes / token | of exact | decode tok/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['perplexity']:.2f} | {r['mean_nll_increase']:+.3f} | "
              f"{100 * r['top1_same_as_exact']:.1f} % | {r['kv_bytes_per_token']:,.0f} | "
              f"{r['kv_share_of_exact']:.2f} | {r['decode_tok_s']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()

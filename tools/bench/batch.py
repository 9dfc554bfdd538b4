#!/usr/bin/env python3
"""Batched decoding: Model.generate_batch on B prompts against the same prompts generated
one after another (Model.generate), in one run, for each batch size asked for.

The prompts are --prompt-tokens tokens each from different places of real text (default:
the held-out State of the Union text, uint16 ids as tools/train/data.py writes them);
every generation is greedy, --new-tokens long, never stopping early (no EOS), so both
sides produce the same number of tokens. Rounds alternate the order of the two sides;
reported are medians over rounds of the generated tokens per second of the whole batch
(all tokens over the wall time, prefills included), of the decode steps alone (the
results' decode seconds: for the batched side the longest sequence's, whose steps every
sequence shares; for the other the sum) and the speed-ups. The two sides must give the
same tokens.

    python tools/bench/batch.py --threads 2 --batches 1,2,4,8 --repeat 3 --json batch.json

With --server the same prompts go to `tinyloop serve` instead (in process, --parallel B,
no prompt cache), as B concurrent streamed greedy completions: the server with batched
decode steps against the same server without them (`batch_decode=False`: the B
generations run side by side in their own threads). Reported per side: tokens per second
of the whole batch and the median time to first token; the answers must be the same.
"""
import argparse
import json
import platform
import statistics
import threading
import time
from pathlib import Path

import numpy as np

import tinyloop
from prompt_cache import stream_completion   # this folder's: a streamed request, timed
from tinyloop.default_model import default_model_path
from tinyloop.server import ModelServer

REPO = Path(__file__).resolve().parents[2]


def prompts_from(text: np.ndarray, count: int, length: int) -> list:
    starts = np.linspace(0, len(text) - length - 1, count).astype(int)
    return [text[s:s + length].astype(np.int32) for s in starts]


def timed(fn) -> tuple:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def serve_concurrently(server: ModelServer, prompts: list, new_tokens: int) -> tuple:
    """(answers, seconds for all, times to first token, tokens generated) of the prompts
    sent at once."""
    port = server.server_address[1]
    n = len(prompts)
    answers, firsts, counts, barrier = [None] * n, [None] * n, [0] * n, threading.Barrier(n)

    def one(i):
        barrier.wait()
        body = {"prompt": prompts[i].tolist(), "max_tokens": new_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        answers[i], firsts[i], _, usage = stream_completion(port, body)
        counts[i] = usage["completion_tokens"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers, time.perf_counter() - t0, firsts, sum(counts)


def bench_server(model, text, size: int, args) -> dict:
    prompts = prompts_from(text, size, args.prompt_tokens)
    servers = {"batched": ModelServer(("127.0.0.1", 0), model, name="m", parallel=size, prompt_cache=0,
                                      batch_decode=True),
               "alone": ModelServer(("127.0.0.1", 0), model, name="m", parallel=size, prompt_cache=0,
                                    batch_decode=False)}
    for server in servers.values():
        threading.Thread(target=server.serve_forever, daemon=True).start()
    speed, ttft = {name: [] for name in servers}, {name: [] for name in servers}
    try:
        for r in range(args.repeat):
            order = list(servers) if r % 2 == 0 else list(servers)[::-1]
            answers = {}
            for name in order:
                answers[name], seconds, firsts, generated = serve_concurrently(servers[name], prompts,
                                                                              args.new_tokens)
                speed[name].append(generated / seconds)
                ttft[name].append(statistics.median(firsts))
            if answers["batched"] != answers["alone"]:
                raise SystemExit(f"server batch {size}: the batched answers differ")
    finally:
        for server in servers.values():
            server.shutdown()
            server.server_close()
    row = {"batch": size, "batched_tok_s": statistics.median(speed["batched"]),
           "alone_tok_s": statistics.median(speed["alone"]),
           "batched_ttft_s": statistics.median(ttft["batched"]), "alone_ttft_s": statistics.median(ttft["alone"])}
    row["speedup"] = row["batched_tok_s"] / row["alone_tok_s"]
    print(f"server, {size} at once: {row['batched_tok_s']:.1f} tok/s batched, {row['alone_tok_s']:.1f} tok/s "
          f"side by side ({row['speedup']:.2f}x); median time to first token {row['batched_ttft_s'] * 1e3:.0f} "
          f"against {row['alone_ttft_s'] * 1e3:.0f} ms", flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="a .tinyloop file (default: the shipped model)")
    ap.add_argument("--text", default=str(REPO / ".traindata" / "tokens" / "eval_sotu.u16"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--server", action="store_true", help="concurrent requests to `tinyloop serve`")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    model = tinyloop.Model(args.model or default_model_path(), device=args.device, threads=args.threads)
    text = np.fromfile(args.text, dtype=np.uint16)
    options = {"max_tokens": args.new_tokens, "temperature": 0.0, "eos": False}
    model.generate(text[:args.prompt_tokens].astype(np.int32), **options)   # warm-up
    rows = []
    for size in [int(b) for b in args.batches.split(",")]:
        if args.server:
            rows.append(bench_server(model, text, size, args))
            continue
        prompts = prompts_from(text, size, args.prompt_tokens)
        batched, alone = [], []
        for r in range(args.repeat):
            sides = [("batched", lambda: model.generate_batch(prompts, **options)),
                     ("alone", lambda: [model.generate(p, **options) for p in prompts])]
            if r % 2:
                sides.reverse()
            results = {}
            for name, fn in sides:
                results[name], seconds = timed(fn)
                tokens = sum(len(res.tokens) for res in results[name])
                steps = sum(len(res.tokens) - 1 for res in results[name])
                # batched steps are shared: every sequence counts the whole step's time
                decode = (max if name == "batched" else sum)(res.decode_seconds for res in results[name])
                (batched if name == "batched" else alone).append((tokens / seconds, steps / decode))
            if [res.tokens for res in results["batched"]] != [res.tokens for res in results["alone"]]:
                raise SystemExit(f"batch {size}: the batched tokens differ from the ones generated alone")
        row = {"batch": size,
               "batched_tok_s": statistics.median(b[0] for b in batched),
               "alone_tok_s": statistics.median(a[0] for a in alone),
               "batched_decode_tok_s": statistics.median(b[1] for b in batched),
               "alone_decode_tok_s": statistics.median(a[1] for a in alone)}
        row["speedup"] = row["batched_tok_s"] / row["alone_tok_s"]
        row["decode_speedup"] = row["batched_decode_tok_s"] / row["alone_decode_tok_s"]
        rows.append(row)
        print(f"batch {size}: {row['batched_tok_s']:.1f} tok/s batched, {row['alone_tok_s']:.1f} tok/s "
              f"one after another ({row['speedup']:.2f}x); decode steps alone "
              f"{row['batched_decode_tok_s']:.1f} against {row['alone_decode_tok_s']:.1f} tok/s "
              f"({row['decode_speedup']:.2f}x)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": args.device, "threads": args.threads, "server": args.server,
                                               "machine": platform.processor() or platform.machine(),
                                               "prompt_tokens": args.prompt_tokens,
                                               "new_tokens": args.new_tokens, "repeat": args.repeat,
                                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

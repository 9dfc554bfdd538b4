#!/usr/bin/env python3
"""The choices of one completions request (n, a list of prompts) batched against run one
after another: `tinyloop serve` in process, two servers on one model, one with its
choices batched (the default) and one with `batch_choices=False`, no prompt cache, one
slot. Each case is one request, sampled with a seed (the answers of the two sides must be
the same); rounds alternate which side goes first; reported are the medians over rounds
of the request's wall time and of the tokens generated per second, and the speed-up.

    python tools/bench/server_choices.py --threads 2 --repeat 5
"""
import argparse
import http.client
import json
import platform
import statistics
import threading
import time

import tinyloop
from tinyloop.default_model import default_model_path
from tinyloop.server import ModelServer

PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz",
    "To make a good cup of tea, first bring fresh water to the boil, then",
    "The committee met on Tuesday to discuss the budget for the coming year. After a long debate,",
    "In the small village at the foot of the mountains, the winter of that year was",
]


def post(port: int, body: dict) -> tuple:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json"})
    reply = json.loads(conn.getresponse().read())
    elapsed = time.perf_counter() - t0
    conn.close()
    if "choices" not in reply:
        raise SystemExit(f"request failed: {reply}")
    return reply, elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the shipped default model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--choices", default="1,4,8", help="values of n for the first prompt")
    ap.add_argument("--repeat", type=int, default=5, help="rounds")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()

    path = args.model or default_model_path()
    cases = [(f"n={n}", {"prompt": PROMPTS[0], "n": n}) for n in map(int, args.choices.split(","))]
    cases.append((f"{len(PROMPTS)} prompts", {"prompt": PROMPTS, "n": 1}))
    with tinyloop.Model(path, threads=args.threads) as model:
        servers = {side: ModelServer(("127.0.0.1", 0), model, name="bench", parallel=1, prompt_cache=0,
                                     batch_choices=(side == "batched"))
                   for side in ("batched", "sequential")}
        threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers.values()]
        for t in threads:
            t.start()
        try:
            results = {}
            for name, case in cases:
                body = dict(case, max_tokens=args.max_tokens, temperature=0.8, seed=1)
                post(servers["batched"].server_address[1], body)   # warm up
                times = {side: [] for side in servers}
                tokens = None
                for r in range(args.repeat):
                    order = ["batched", "sequential"] if r % 2 == 0 else ["sequential", "batched"]
                    answers = {}
                    for side in order:
                        reply, elapsed = post(servers[side].server_address[1], body)
                        times[side].append(elapsed)
                        answers[side] = [c["text"] for c in reply["choices"]]
                        tokens = reply["usage"]["completion_tokens"]
                    if answers["batched"] != answers["sequential"]:
                        raise SystemExit(f"{name}: the two sides answered differently")
                med = {side: statistics.median(t) for side, t in times.items()}
                results[name] = {"completion_tokens": tokens,
                                 **{f"{side}_s": med[side] for side in med},
                                 **{f"{side}_tok_s": tokens / med[side] for side in med},
                                 "speedup": med["sequential"] / med["batched"]}
                print(f"{name:>10}: {tokens:4d} tokens  batched {med['batched'] * 1e3:7.1f} ms "
                      f"({tokens / med['batched']:6.1f} tok/s)  sequential {med['sequential'] * 1e3:7.1f} ms "
                      f"({tokens / med['sequential']:6.1f} tok/s)  x{results[name]['speedup']:.2f}", flush=True)
        finally:
            for s in servers.values():
                s.shutdown()
                s.server_close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": str(path), "threads": args.threads, "max_tokens": args.max_tokens,
                       "repeat": args.repeat, "machine": platform.processor() or platform.machine(),
                       "date": time.strftime("%Y-%m-%d"), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

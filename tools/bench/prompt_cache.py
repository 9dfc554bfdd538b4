#!/usr/bin/env python3
"""The server's prompt cache on a multi-turn conversation: `tinyloop serve` with kept
sequences against the same server without them (`prompt_cache=0`), in one run.

Each conversation starts with --first tokens of real text (default: the held-out State of
the Union text, uint16 ids as tools/train/data.py writes them) and goes on for --turns
turns: a streamed greedy completion of --answer tokens, then the prompt grows by that
answer and the next --user tokens of the text, as a chat client resends its history.
Rounds alternate the two servers, each round on the next part of the text (so its first
turn finds nothing kept); reported are medians over rounds of the whole
conversation's seconds and of each turn's time to first token, with the cached prompt
tokens the server reported. The two servers' answers must be the same text.

    python tools/bench/prompt_cache.py --threads 2 --repeat 3 --json prompt_cache.json
"""
import argparse
import http.client
import json
import platform
import statistics
import threading
import time
from pathlib import Path

import numpy as np

import tinyloop
from tinyloop.default_model import default_model_path
from tinyloop.server import ModelServer

REPO = Path(__file__).resolve().parents[2]


def stream_completion(port: int, body: dict) -> tuple:
    """(text, seconds to the first text, seconds in all, usage) of one streamed request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise SystemExit(f"the server answered {response.status}: {response.read()[:300]!r}")
    text, first, usage = "", None, None
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if event.get("usage"):
            usage = event["usage"]
        for choice in event.get("choices", []):
            if choice.get("text") and first is None:
                first = time.perf_counter() - t0
            text += choice.get("text", "")
    conn.close()
    return text, first, time.perf_counter() - t0, usage


def conversation(port: int, tokens: np.ndarray, tokenizer, args) -> dict:
    prompt = tokens[:args.first].tolist()
    at, turns = args.first, []
    for _ in range(args.turns):
        body = {"prompt": prompt, "max_tokens": args.answer, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        text, first, seconds, usage = stream_completion(port, body)
        turns.append({"ttft_s": first, "seconds": seconds, "text": text,
                      "prompt_tokens": usage["prompt_tokens"],
                      "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]})
        # the client resends the history as text would be: the answer encoded again
        prompt = prompt + tokenizer.encode(text, add_bos=False) + tokens[at:at + args.user].tolist()
        at += args.user
    return {"seconds": sum(t["seconds"] for t in turns), "turns": turns}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the packaged default model")
    ap.add_argument("--tokens", default=str(REPO / ".traindata" / "tokens" / "eval_sotu.u16"))
    ap.add_argument("--first", type=int, default=512)
    ap.add_argument("--user", type=int, default=64)
    ap.add_argument("--answer", type=int, default=32)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    tokens = np.fromfile(args.tokens, dtype=np.uint16).astype(np.int32)
    need = args.first + args.turns * args.user
    if len(tokens) < need * args.repeat:
        raise SystemExit(f"{args.tokens} holds {len(tokens)} tokens, fewer than {need * args.repeat}")
    path = args.model or str(default_model_path())
    with tinyloop.Model(path, device=args.device, threads=args.threads) as model:
        model_device = model.info.device_name
        if need + args.turns * args.answer > model.info.max_seq_len:
            raise SystemExit(f"the conversation outgrows the context ({model.info.max_seq_len})")
        servers = {"cached": ModelServer(("127.0.0.1", 0), model, name="m", prompt_cache=1),
                   "uncached": ModelServer(("127.0.0.1", 0), model, name="m", prompt_cache=0)}
        threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers.values()]
        for t in threads:
            t.start()
        runs = {name: [] for name in servers}
        try:
            for r in range(args.repeat):   # each round its own text: nothing kept from the last
                for name, server in servers.items():
                    runs[name].append(conversation(server.server_address[1], tokens[r * need:],
                                                   model.tokenizer, args))
        finally:
            for server in servers.values():
                server.shutdown()
                server.server_close()
    texts = {name: [t["text"] for run in r for t in run["turns"]] for name, r in runs.items()}
    if texts["cached"] != texts["uncached"]:
        raise SystemExit("the cached server answered differently from the uncached one")
    res = {"model": Path(path).name, "machine": platform.processor() or platform.machine(),
           "device": model_device, "threads": args.threads, "first": args.first, "user": args.user, "answer": args.answer,
           "turns": args.turns, "repeat": args.repeat}
    print(f"{args.turns} turns from {args.first} tokens (+{args.user} text, {args.answer} answer "
          f"per turn), {res['model']} on {model_device}, threads {args.threads}, median of {args.repeat}")
    for name, r in runs.items():
        ttft = [statistics.median(run["turns"][i]["ttft_s"] for run in r) for i in range(args.turns)]
        res[name] = {"seconds": statistics.median(run["seconds"] for run in r), "ttft_s": ttft,
                     "prompt_tokens": [t["prompt_tokens"] for t in r[0]["turns"]],
                     "cached_tokens": [t["cached_tokens"] for t in r[0]["turns"]]}
        print(f"  {name:9s} conversation {res[name]['seconds']:.2f} s; time to first token per turn "
              + " ".join(f"{t * 1000:.0f}" for t in ttft) + " ms; cached prompt tokens "
              + " ".join(str(c) for c in res[name]["cached_tokens"]))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

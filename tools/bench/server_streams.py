"""Concurrent streaming clients against `tinyloop serve` (docs/benchmarks.md, "The server
under concurrent streams"): the server is started as a child on loopback; for each
client count C, C clients released together each stream one completion of --max-tokens
tokens on its own connection. Per count: the aggregate tokens/s (every client's events
over the wall time from release to the last [DONE]), time to the first token p50/p99,
inter-token latency p50/p99 (gaps between a stream's events), and streams lost.

    python tools/bench/server_streams.py -m MODEL --device cuda --parallel 64 \
        --clients 1,16,64,256 --max-tokens 128 --json F
"""

from __future__ import annotations

import argparse
import http.client
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_soak import free_port, wait_healthy  # noqa: E402  (tools/bench)


def stream(port: int, body: bytes, timeout: float, out: list, lock, release: threading.Event) -> None:
    """One streamed completion: the monotonic time of each token event, or the error."""
    release.wait()
    started = time.monotonic()
    row = {"started": started, "events": [], "done": False}
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        row["status"] = response.status
        while line := response.readline():
            if line.startswith(b"data: [DONE]"):
                row["done"] = True
            elif line.startswith(b"data: "):
                row["events"].append(time.monotonic())
        conn.close()
    except OSError as e:
        row["error"] = f"{type(e).__name__}: {e}"
    with lock:
        out.append(row)


def run_count(port: int, clients: int, args) -> dict:
    # token ids (a model without a tokenizer, e.g. a random benchmark model) or the text
    prompt = list(range(1, args.prompt_tokens + 1)) if args.prompt_tokens else args.prompt
    body = json.dumps({"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                       "stream": True}).encode()
    out, lock, release = [], threading.Lock(), threading.Event()
    threads = [threading.Thread(target=stream, args=(port, body, args.timeout, out, lock, release))
               for _ in range(clients)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    release.set()
    for t in threads:
        t.join()
    answered = [r for r in out if r["done"] and r["events"]]
    end = max((r["events"][-1] for r in answered), default=t0)
    ttft = [r["events"][0] - r["started"] for r in answered]
    itl = [b - a for r in answered for a, b in zip(r["events"], r["events"][1:])]
    tokens = sum(len(r["events"]) for r in answered)

    def pct(xs, q):
        return round(1000 * float(np.percentile(xs, q)), 2) if xs else None
    return {"clients": clients, "answered": len(answered), "lost": clients - len(answered),
            "tokens": tokens, "wall_s": round(end - t0, 3), "tok_s": round(tokens / max(end - t0, 1e-9), 1),
            "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
            "itl_ms_p50": pct(itl, 50), "itl_ms_p99": pct(itl, 99),
            "statuses": sorted({r.get("status", 0) for r in out}),
            "errors": sorted({r["error"] for r in out if "error" in r})[:5]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default=None, help="a model file (default: the shipped model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--parallel", type=int, default=16)
    p.add_argument("--clients", default="1,16,64,256", help="client counts, run one after another")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt", default="The sea")
    p.add_argument("--prompt-tokens", type=int, default=0, help="send ids 1..N as the prompt instead of text")
    p.add_argument("--timeout", type=float, default=300, help="a client's socket timeout (300 s)")
    p.add_argument("--serve-arg", action="append", default=[], help="one more `tinyloop serve` argument")
    p.add_argument("--json", help="write the rows to this file")
    args = p.parse_args()

    counts = [int(c) for c in args.clients.split(",")]
    port = free_port()
    command = [sys.executable, "-m", "tinyloop", "serve", "--port", str(port), "--threads", str(args.threads),
               "--device", args.device, "--parallel", str(args.parallel),
               "--max-waiting", str(max(counts))] + (["-m", args.model] if args.model else []) + args.serve_arg
    log = tempfile.TemporaryFile()
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    result = {"command": command, "rows": []}
    try:
        wait_healthy(port, server)
        run_count(port, 1, args)   # warm-up: the first step's graphs and the prompt's cache
        for clients in counts:
            row = run_count(port, clients, args)
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            if args.json:   # what is measured so far survives a time-out
                Path(args.json).write_text(json.dumps(result, indent=1))
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    log.seek(0)
    text = log.read()
    result["server_tracebacks"] = text.count(b"Traceback")
    if any(row["lost"] for row in result["rows"]):   # what the server said about it
        result["server_log_tail"] = text[-4000:].decode(errors="replace")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

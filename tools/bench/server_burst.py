"""A burst of concurrent streaming completions against a running `tinyloop serve` on
loopback (docs/benchmarks.md, "The server under a burst"): N clients, released together,
each POSTs one streamed completion on its own connection; the summary counts the
answered streams (ending in [DONE]), the 429s (with Retry-After), other statuses and the
connections reset or failed, with the time to the first event (p50, p99) of the answered.

    python tools/bench/server_burst.py --port 8080 --clients 256 --max-tokens 16
"""

from __future__ import annotations

import argparse
import http.client
import json
import threading
import time


def request(port: int, path: str, body: bytes, timeout: float, cut_after: int | None = None) -> dict:
    """One POST on its own connection: its status, for a stream the time to the first event
    and whether it ended in [DONE], the whole latency, or the error that cut it. With
    `cut_after`, the client hangs up after that many events (a client leaving mid-stream)."""
    started = time.monotonic()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200 or not response.getheader("Content-Type", "").startswith("text/event-stream"):
            response.read()
            conn.close()
            return {"status": response.status, "retry_after": response.getheader("Retry-After"),
                    "latency": time.monotonic() - started}
        first, last, events = None, None, 0
        while line := response.readline():
            if line.startswith(b"data: "):
                first = first if first is not None else time.monotonic() - started
                last, events = line.strip(), events + 1
                if cut_after is not None and events >= cut_after:
                    break
        conn.close()
        return {"status": 200, "ttft": first, "done": last == b"data: [DONE]", "events": events,
                "latency": time.monotonic() - started}
    except Exception as e:   # a reset, a refused connection, a timeout
        return {"status": None, "error": type(e).__name__, "latency": time.monotonic() - started}


def percentile(values: list, q: float, digits: int = 3) -> float | None:
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], digits) if values else None


def one(port: int, body: bytes, barrier: threading.Barrier, out: list, timeout: float) -> None:
    barrier.wait()
    out.append(request(port, "/v1/completions", body, timeout))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--clients", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt", default="The sea")
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args()
    body = json.dumps({"prompt": args.prompt, "max_tokens": args.max_tokens, "temperature": 0,
                       "stream": True}).encode()
    out: list = []
    barrier = threading.Barrier(args.clients)
    threads = [threading.Thread(target=one, args=(args.port, body, barrier, out, args.timeout))
               for _ in range(args.clients)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ttfts = [r["ttft"] for r in out if r["status"] == 200 and r["ttft"] is not None]
    errors: dict = {}
    for r in out:
        if r["status"] is None:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    print(json.dumps({
        "clients": args.clients, "wall_s": round(time.monotonic() - started, 2),
        "answered": sum(1 for r in out if r["status"] == 200 and r.get("done")),
        "streams_cut": sum(1 for r in out if r["status"] == 200 and not r.get("done")),
        "429_with_retry_after": sum(1 for r in out if r["status"] == 429 and r["retry_after"]),
        "other_status": sorted({r["status"] for r in out if r["status"] not in (None, 200, 429)}),
        "failed": errors, "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p99_s": percentile(ttfts, 0.99)}))


if __name__ == "__main__":
    main()

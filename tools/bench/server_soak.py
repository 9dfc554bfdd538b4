"""A soak run of `tinyloop serve` on loopback (docs/benchmarks.md, "Server soak"): starts
the server (the shipped default model unless -m) as a child process, keeps N clients
busy for the given minutes with a mix of streamed completions, streamed and whole chats,
embeddings and streams the client leaves after a few events, and samples the server
process's RSS, threads and open file descriptors every --sample seconds. The summary:
requests answered and errors by kind, latency p50 / p99 by request kind, and the
resources of the first minute against the last.

    python tools/bench/server_soak.py --minutes 5 --clients 16 --threads 2 --parallel 4
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

from server_burst import percentile, request

PROMPTS = ["The sea", "Once upon a time", "A loop is", "The capital of France is", "def add(a, b):"]


def kinds(max_tokens: int) -> dict:
    """Each kind: the route, a body for a prompt, and after how many events the client leaves."""
    chat = lambda p, stream: {"messages": [{"role": "user", "content": p}], "max_tokens": max_tokens,  # noqa: E731
                              "temperature": 0.8, "stream": stream}
    return {
        "completion_stream": ("/v1/completions", lambda p: {"prompt": p, "max_tokens": max_tokens,
                                                            "temperature": 0.8, "stream": True}, None),
        "chat_stream": ("/v1/chat/completions", lambda p: chat(p, True), None),
        "chat": ("/v1/chat/completions", lambda p: chat(p, False), None),
        "embeddings": ("/v1/embeddings", lambda p: {"input": [p, p + " again"]}, None),
        # the client hangs up after 3 events: the server must free the slot and the socket
        "stream_cut": ("/v1/completions", lambda p: {"prompt": p, "max_tokens": 4 * max_tokens,
                                                     "stream": True}, 3),
    }


def outcome(kind: str, r: dict, cut: int | None) -> str:
    if r["status"] is None:
        return r["error"]
    if r["status"] != 200:
        return f"status {r['status']}"
    if "events" in r:
        if cut is not None:
            return "ok" if r["events"] >= cut else "stream ended early"
        return "ok" if r["done"] else "stream without [DONE]"
    return "ok"


def client(port: int, deadline: float, mix: list, table: dict, timeout: float, out: list, lock) -> None:
    for n, kind in enumerate(mix):
        if time.monotonic() >= deadline:
            return
        path, body, cut = table[kind]
        r = request(port, path, json.dumps(body(PROMPTS[n % len(PROMPTS)])).encode(), timeout, cut_after=cut)
        r["kind"], r["outcome"], r["at"] = kind, outcome(kind, r, cut), time.monotonic()
        with lock:
            out.append(r)


def sample(pid: int) -> dict:
    status = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            status[key] = value.split()
    return {"rss_mib": int(status["VmRSS"][0]) / 1024, "threads": int(status["Threads"][0]),
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def sampler(pid: int, every: float, stop: threading.Event, samples: list, started: float) -> None:
    while True:
        try:
            samples.append({"t": round(time.monotonic() - started, 1), **sample(pid)})
        except (FileNotFoundError, ProcessLookupError):
            return
        if stop.wait(every):
            return


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, proc: subprocess.Popen, limit: float = 120) -> None:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before answering /health")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit("the server did not answer /health in time")


def trend(samples: list, lo: float, hi: float) -> dict:
    """[min, max] of each resource over the samples taken from lo to hi seconds."""
    part = [s for s in samples if lo <= s["t"] < hi] or samples[:1]
    return {key: [round(min(s[key] for s in part), 1), round(max(s[key] for s in part), 1)]
            for key in ("rss_mib", "threads", "fds")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=5)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("-m", "--model", default=None, help="a model file (default: the shipped model)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--sample", type=float, default=10, help="seconds between resource samples (10)")
    p.add_argument("--timeout", type=float, default=120, help="a client's socket timeout (120 s)")
    p.add_argument("--json", help="write the samples and the summary to this file")
    args = p.parse_args()

    port = free_port()
    command = [sys.executable, "-m", "tinyloop", "serve", "--port", str(port), "--threads", str(args.threads),
               "--parallel", str(args.parallel)] + (["-m", args.model] if args.model else [])
    log = tempfile.TemporaryFile()
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(port, server)
        table = kinds(args.max_tokens)
        # every client cycles through the kinds from its own offset: the mix stays even
        names = list(table)
        out, lock, stop, samples = [], threading.Lock(), threading.Event(), []
        started = time.monotonic()
        deadline = started + 60 * args.minutes
        watch = threading.Thread(target=sampler, args=(server.pid, args.sample, stop, samples, started))
        watch.start()
        clients = [threading.Thread(target=client, args=(
            port, deadline, itertools.islice(itertools.cycle(names), i % len(names), None), table,
            args.timeout, out, lock)) for i in range(args.clients)]
        for t in clients:
            t.start()
        for t in clients:
            t.join()
        wall = time.monotonic() - started
        time.sleep(min(args.sample, 2))   # the last cut streams' slots and sockets go back
        samples.append({"t": round(time.monotonic() - started, 1), **sample(server.pid)})
        stop.set()
        watch.join()
    finally:
        server.terminate()
        try:
            code = server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            code = server.wait()
    log.seek(0)
    tracebacks = log.read().count(b"Traceback")

    errors: dict = {}
    for r in out:
        if r["outcome"] != "ok":
            errors[f"{r['kind']}: {r['outcome']}"] = errors.get(f"{r['kind']}: {r['outcome']}", 0) + 1
    by_kind = {}
    for kind in names:
        done = [r for r in out if r["kind"] == kind and r["outcome"] == "ok"]
        by_kind[kind] = {"answered": len(done),
                         "p50_s": percentile([r["latency"] for r in done], 0.5),
                         "p99_s": percentile([r["latency"] for r in done], 0.99)}
        if kind.endswith("stream") or kind == "stream_cut":
            by_kind[kind]["ttft_p50_s"] = percentile([r["ttft"] for r in done if r.get("ttft")], 0.5)
    # samples[0] is taken as the load starts and samples[-1] after it: the trend is of those between
    during, last = samples[1:-1] or samples, samples[-2]["t"]
    summary = {
        "command": " ".join(command[1:]), "clients": args.clients, "wall_s": round(wall, 1),
        "requests": len(out), "answered": sum(r["outcome"] == "ok" for r in out),
        "per_s": round(len(out) / wall, 2), "errors": errors, "by_kind": by_kind,
        "latency_p50_s": percentile([r["latency"] for r in out if r["outcome"] == "ok"], 0.5),
        "latency_p99_s": percentile([r["latency"] for r in out if r["outcome"] == "ok"], 0.99),
        "before_load": samples[0], "first_minute": trend(during, 0, 60),
        "last_minute": trend(during, last - 60, last + 1), "after_load": samples[-1], "server_tracebacks": tracebacks, "server_exit": code}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "samples": samples}, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

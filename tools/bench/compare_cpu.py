#!/usr/bin/env python3
"""CPU benchmark: TinyLoop against llama.cpp on the same GGUF, in one run.

TinyLoop runs in this interpreter (the installed `tinyloop` package) on the converted
`.tinyloop` file; llama.cpp runs through its ordinary Python package (`llama_cpp`) in
another interpreter given by --llama-python (a scratch venv with llama-cpp-python; it
is never a dependency of TinyLoop). Both get the same prompt token ids, the same thread
count and batch 1; runs alternate A/B and the medians are reported, beside the memory
bandwidth floor (weight bytes read per decoded token / measured read bandwidth).

    python tools/bench/compare_cpu.py --model smollm2-135m --gguf path/to/model.gguf \
        --llama-python /path/to/venv/bin/python --threads 2 --repeat 5
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

LLAMA_WORKER = r"""
import json, sys, time
import llama_cpp
cfg = json.loads(sys.argv[1])
llm = llama_cpp.Llama(model_path=cfg["gguf"], n_threads=cfg["threads"],
                      n_threads_batch=cfg["threads"], n_ctx=cfg["n_ctx"],
                      n_batch=cfg["n_batch"], n_ubatch=cfg["n_batch"], verbose=False)
prompt = cfg["prompt"]
results = []
for _ in range(cfg["inner"]):
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    t1 = time.perf_counter()
    tok = prompt[-1]
    for i in range(cfg["new_tokens"]):
        llm.eval([cfg["decode"][i]])
    t2 = time.perf_counter()
    results.append({"prefill_s": t1 - t0, "decode_s": t2 - t1})
print(json.dumps({"version": llama_cpp.__version__, "runs": results}))
"""


def measure_read_bandwidth(mib=512, repeat=5):
    """Single-pass read bandwidth (GB/s) of a large buffer summed with all cores."""
    buf = np.ones(mib * 1024 * 1024 // 8, dtype=np.float64)
    best = 0.0
    for _ in range(repeat):
        t0 = time.perf_counter()
        buf.sum()
        dt = time.perf_counter() - t0
        best = max(best, buf.nbytes / dt / 1e9)
    return best


def weight_bytes_per_token(model_path):
    """Bytes of weights one decoded token must read (every matrix once, embedding row only)."""
    from tinyloop.format import read_file
    f = read_file(model_path)
    total = 0
    for name, t in f.tensors.items():
        if name == "embed.weight":
            if "output.weight" not in f.tensors:   # tied: the head reads it all
                total += t.size
            else:
                total += t.size // t.shape[0]
        else:
            total += t.size
    return total


def run_tinyloop(model_path, prompt, decode, threads, depth, inner):
    import tinyloop
    out = []
    with tinyloop.Model(str(model_path), threads=threads) as model:
        ctx = model.context(max_seq_len=len(prompt) + len(decode) + 8)
        for _ in range(inner):
            ctx.reset()
            t0 = time.perf_counter()
            ctx.append(prompt, depth=depth)
            t1 = time.perf_counter()
            for tok in decode:
                ctx.append([tok], depth=depth)
            t2 = time.perf_counter()
            out.append({"prefill_s": t1 - t0, "decode_s": t2 - t1})
        ctx.close()
    return out


def run_llama(python, gguf, prompt, decode, threads, inner):
    cfg = {"gguf": str(gguf), "threads": threads, "n_ctx": len(prompt) + len(decode) + 16,
           "n_batch": max(len(prompt), 32), "prompt": prompt, "decode": decode,
           "new_tokens": len(decode), "inner": inner}
    done = subprocess.run([python, "-c", LLAMA_WORKER, json.dumps(cfg)], capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(runs, n_prompt, n_new):
    prefill = statistics.median(n_prompt / r["prefill_s"] for r in runs)
    decode = statistics.median(n_new / r["decode_s"] for r in runs)
    return {"prefill_tokens_per_s": prefill, "decode_tokens_per_s": decode}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help=".tinyloop path or pulled name")
    ap.add_argument("--gguf", help="the GGUF the model was converted from (for llama.cpp)")
    ap.add_argument("--llama-python", help="interpreter with llama_cpp installed")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=5, help="alternating A/B rounds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from tinyloop.convert.pull import resolve_model_name
    model_path = resolve_model_name(args.model)
    rng = np.random.default_rng(0)
    import tinyloop
    with tinyloop.Model(str(model_path), threads=1) as m:
        vocab = m.info.vocab_size
    # Ordinary tokens (ids well inside the vocabulary) so both engines do identical work.
    prompt = [int(t) for t in rng.integers(100, min(vocab, 20000), args.prompt_tokens)]
    decode = [int(t) for t in rng.integers(100, min(vocab, 20000), args.new_tokens)]

    ours, peer = [], []
    peer_version = None
    for _ in range(args.repeat):
        ours += run_tinyloop(model_path, prompt, decode, args.threads, args.depth, 1)
        if args.gguf and args.llama_python:
            res = run_llama(args.llama_python, args.gguf, prompt, decode, args.threads, 1)
            peer += res["runs"]
            peer_version = res["version"]

    bw = measure_read_bandwidth()
    wbytes = weight_bytes_per_token(model_path)
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "threads": args.threads, "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens, "repeat": args.repeat,
        "tinyloop": summarize(ours, args.prompt_tokens, args.new_tokens),
        "read_bandwidth_gb_s": bw,
        "weight_bytes_per_token": wbytes,
        "decode_floor_tokens_per_s": bw * 1e9 / wbytes,
    }
    if peer:
        report["llama_cpp"] = summarize(peer, args.prompt_tokens, args.new_tokens)
        report["llama_cpp_version"] = peer_version
        report["decode_ratio"] = (report["tinyloop"]["decode_tokens_per_s"]
                                  / report["llama_cpp"]["decode_tokens_per_s"])
        report["prefill_ratio"] = (report["tinyloop"]["prefill_tokens_per_s"]
                                   / report["llama_cpp"]["prefill_tokens_per_s"])
    if not args.json:
        print(f"{'engine':<12}{'prefill tok/s':>15}{'decode tok/s':>15}")
        for name in ("tinyloop", "llama_cpp"):
            if name in report:
                r = report[name]
                print(f"{name:<12}{r['prefill_tokens_per_s']:>15.1f}{r['decode_tokens_per_s']:>15.1f}")
        print(f"floor (decode, {bw:.1f} GB/s read, {wbytes / 1e6:.1f} MB/token): "
              f"{report['decode_floor_tokens_per_s']:.1f} tok/s")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

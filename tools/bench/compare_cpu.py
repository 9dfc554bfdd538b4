#!/usr/bin/env python3
"""CPU benchmark: TinyLoop against llama.cpp on the same GGUF, in one run.

TinyLoop runs in this interpreter (the installed `tinyloop` package) on the converted
`.tinyloop` file; llama.cpp runs through its ordinary Python package (`llama_cpp`) in
another interpreter given by --llama-python (a scratch venv with llama-cpp-python; it
is never a dependency of TinyLoop). Both get the same prompt token ids, the same thread
count and batch 1; runs alternate A/B and the medians are reported, beside the memory
bandwidth floor (weight bytes read per decoded token / measured read bandwidth).

Every timed run is a fresh subprocess that loads its engine, times one prefill and the
decode steps and reports its peak resident set (ru_maxrss, mapped weight pages
included) and the resident set before the engine loaded the model (the interpreter and
imports), so memory is compared beside speed.

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

# Both workers end with the same report: timings, peak RSS and RSS before the model.
WORKER_REPORT = r"""
import resource
def rss_now():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0
def report(runs, **extra):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # KiB on Linux
    print(json.dumps(dict(runs=runs, peak_rss_bytes=peak, base_rss_bytes=BASE_RSS, **extra)))
"""

TINYLOOP_WORKER = r"""
import json, sys, time
import tinyloop
""" + WORKER_REPORT + r"""
BASE_RSS = rss_now()
cfg = json.loads(sys.argv[1])
runs = []
with tinyloop.Model(cfg["model"], threads=cfg["threads"]) as model:
    ctx = model.context(max_seq_len=len(cfg["prompt"]) + len(cfg["decode"]) + 8)
    for _ in range(cfg["inner"]):
        ctx.reset()
        t0 = time.perf_counter()
        ctx.append(cfg["prompt"], depth=cfg["depth"])
        t1 = time.perf_counter()
        for tok in cfg["decode"]:
            ctx.append([tok], depth=cfg["depth"])
        t2 = time.perf_counter()
        runs.append({"prefill_s": t1 - t0, "decode_s": t2 - t1})
    ctx.close()
report(runs, version=tinyloop.__version__)
"""

LLAMA_WORKER = r"""
import json, sys, time
import llama_cpp
""" + WORKER_REPORT + r"""
BASE_RSS = rss_now()
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
report(results, version=llama_cpp.__version__)
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
    from tinyloop.fileformat.tinyloop_file import read_file
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


def run_worker(python, script, cfg):
    """Run one engine's timing in its own process; its JSON report (last line)."""
    done = subprocess.run([python, "-c", script, json.dumps(cfg)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{python} worker failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_tinyloop(model_path, prompt, decode, threads, depth, inner):
    cfg = {"model": str(model_path), "threads": threads, "depth": depth, "prompt": prompt,
           "decode": decode, "inner": inner}
    return run_worker(sys.executable, TINYLOOP_WORKER, cfg)


def run_llama(python, gguf, prompt, decode, threads, inner):
    cfg = {"gguf": str(gguf), "threads": threads, "n_ctx": len(prompt) + len(decode) + 16,
           "n_batch": max(len(prompt), 32), "prompt": prompt, "decode": decode,
           "new_tokens": len(decode), "inner": inner}
    return run_worker(python, LLAMA_WORKER, cfg)


def summarize(reports, n_prompt, n_new):
    runs = [r for rep in reports for r in rep["runs"]]
    mib = 1024 * 1024
    return {
        "prefill_tokens_per_s": statistics.median(n_prompt / r["prefill_s"] for r in runs),
        "decode_tokens_per_s": statistics.median(n_new / r["decode_s"] for r in runs),
        "decode_tokens_per_s_runs": [round(n_new / r["decode_s"], 1) for r in runs],
        "peak_rss_mib": max(rep["peak_rss_bytes"] for rep in reports) / mib,
        "base_rss_mib": statistics.median(rep["base_rss_bytes"] for rep in reports) / mib,
        "version": reports[-1]["version"],
    }


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
    for _ in range(args.repeat):
        ours.append(run_tinyloop(model_path, prompt, decode, args.threads, args.depth, 1))
        if args.gguf and args.llama_python:
            peer.append(run_llama(args.llama_python, args.gguf, prompt, decode, args.threads, 1))

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
        report["llama_cpp_version"] = report["llama_cpp"]["version"]
        report["decode_ratio"] = (report["tinyloop"]["decode_tokens_per_s"]
                                  / report["llama_cpp"]["decode_tokens_per_s"])
        report["prefill_ratio"] = (report["tinyloop"]["prefill_tokens_per_s"]
                                   / report["llama_cpp"]["prefill_tokens_per_s"])
    if not args.json:
        print(f"{'engine':<12}{'prefill tok/s':>15}{'decode tok/s':>15}"
              f"{'peak RSS MiB':>15}{'before load':>13}")
        for name in ("tinyloop", "llama_cpp"):
            if name in report:
                r = report[name]
                print(f"{name:<12}{r['prefill_tokens_per_s']:>15.1f}{r['decode_tokens_per_s']:>15.1f}"
                      f"{r['peak_rss_mib']:>15.1f}{r['base_rss_mib']:>13.1f}")
        print(f"floor (decode, {bw:.1f} GB/s read, {wbytes / 1e6:.1f} MB/token): "
              f"{report['decode_floor_tokens_per_s']:.1f} tok/s")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Per-kernel GPU time of a decode run, of a batched decode run and of a prefill, for
tools/gpu_check.

  kernel_profile.py run PATH --what decode|batch|prefill --device D   the workload to trace
  kernel_profile.py summarize CSV --what W --tokens N            table from a profiler's CSV
  kernel_profile.py timeline CSV|JSON                             gaps between decode kernels

`run` decodes 64 greedy tokens after a 128-token prompt (batch: 64 greedy steps of
generate_batch over BATCH_ROWS 8-token prompts, so that the prompts' prefill is small
beside the steps; prefill: appends 512 tokens once, after a warm-up); with `--trace FILE` it records the run with PyTorch's profiler (CUPTI,
every kernel of the process, graph nodes one by one) into a Chrome trace, for machines
without nsys. `summarize` reads either nsys's cuda_gpu_kern_sum CSV or ncu's
gpu__time_duration CSV and prints, per kernel, the launches and GPU time per decoded
token (or per prefill), so the step's time can be split between GEMVs, attention and
the small kernels. `timeline` reads nsys's cuda_gpu_trace CSV (or the Chrome trace of
`run --trace`) of the decode run and prints, per kernel and per position in a step, the
median time it adds to the step (its end minus the later of its start and the previous
kernel's end) and the median gap or overlap before it: whether launches leave the GPU
idle, and whether programmatic dependent launch overlaps them.
"""

import argparse
import collections
import csv
import json
import re
import sys

import numpy as np

DECODE_TOKENS = 64
BATCH_ROWS = 64


def cmd_run(args):
    if args.trace:
        import torch
        from torch.profiler import ProfilerActivity, profile
        torch.cuda.init()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            _workload(args)
        prof.export_chrome_trace(args.trace)
    else:
        _workload(args)


def _workload(args):
    import tinyloop
    with tinyloop.Model(args.path, device=args.device) as model:
        vocab = model.info.vocab_size
        rng = np.random.default_rng(0)
        if args.what == "decode":
            prompt = rng.integers(0, vocab, 128).astype(np.int32)
            model.generate(prompt[:16], max_tokens=4, temperature=0.0, eos=False)   # warm-up
            res = model.generate(prompt, max_tokens=DECODE_TOKENS, temperature=0.0, eos=False)
            print(f"decode {res.decode_tokens_per_s:.1f} tok/s")
        elif args.what == "batch":
            prompts = [rng.integers(0, vocab, 8).astype(np.int32) for _ in range(BATCH_ROWS)]
            model.generate_batch(prompts, max_tokens=4, temperature=0.0, eos=False)   # warm-up
            results = model.generate_batch(prompts, max_tokens=DECODE_TOKENS + 1, temperature=0.0, eos=False)
            decode = max(r.decode_seconds for r in results)
            print(f"batch {BATCH_ROWS}: {BATCH_ROWS * DECODE_TOKENS / decode:.1f} tok/s")
        else:
            for _ in range(2):   # the first pass warms up
                with model.context() as ctx:
                    ctx.append(rng.integers(0, vocab, 512).astype(np.int32))


def _short(name):
    name = name.replace("(anonymous namespace)::", "").replace("(int)", "")
    name = re.sub(r"^void ", "", name)
    return re.sub(r"\(.*", "", name)[:70]                # drop the argument list


def _rows(path):
    with open(path, newline="") as f:
        lines = [line for line in f if line.count(",") >= 2]
    return list(csv.DictReader(lines))


def cmd_summarize(args):
    rows = _rows(args.csv)
    per = collections.defaultdict(lambda: [0, 0.0])   # name -> [launches, ns]
    if rows and "Total Time (ns)" in rows[0]:           # nsys cuda_gpu_kern_sum
        for r in rows:
            per[_short(r["Name"])][0] += int(r["Instances"])
            per[_short(r["Name"])][1] += float(r["Total Time (ns)"])
    else:                                               # ncu --csv, one row per metric
        for r in rows:
            if r.get("Metric Name") != "gpu__time_duration.sum":
                continue
            value = float(r["Metric Value"].replace(",", ""))
            scale = {"nsecond": 1, "usecond": 1e3, "msecond": 1e6}.get(r.get("Metric Unit"), 1)
            per[_short(r["Kernel Name"])][0] += 1
            per[_short(r["Kernel Name"])][1] += value * scale
    total = sum(ns for _, ns in per.values())
    unit = args.tokens
    per_what = {"decode": "token", "batch": f"step of {BATCH_ROWS} rows", "prefill": "prefill"}[args.what]
    print(f"## {args.what}: GPU time per {per_what} "
          f"{total / unit / 1e3:.1f} us over {sum(n for n, _ in per.values()) / unit:.0f} launches "
          f"(whole traced run / {unit})\n")
    print("| kernel | launches | us | share | mean us |")
    print("|---|---:|---:|---:|---:|")
    for name, (n, ns) in sorted(per.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"| {name} | {n / unit:.1f} | {ns / unit / 1e3:.1f} | {ns / total:.1%} | {ns / max(n, 1) / 1e3:.2f} |")


def _kernel_trace(path):
    """(start ns, duration ns, short name) of every kernel, in start order."""
    if path.endswith(".json"):                          # Chrome trace (run --trace)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        return sorted((float(e["ts"]) * 1e3, float(e["dur"]) * 1e3, _short(e["name"])) for e in events
                      if e.get("ph") == "X" and e.get("cat") == "kernel")
    return sorted((float(r["Start (ns)"]), float(r["Duration (ns)"]), _short(r["Name"])) for r in _rows(path))


def _added_and_gap(prev, cur):
    """(time cur adds after prev ends, gap between them; < 0: they overlap), in ns."""
    end0 = prev[0] + prev[1]
    return cur[0] + cur[1] - max(cur[0], end0), cur[0] - end0


def cmd_timeline(args):
    trace = _kernel_trace(args.csv)
    trace = trace[len(trace) // 2:]    # the decode steps (the prompt and the warm-up come first)
    added = collections.defaultdict(list)
    gaps = collections.defaultdict(list)
    for prev, cur in zip(trace, trace[1:]):
        a, g = _added_and_gap(prev, cur)
        added[cur[2]].append(a)
        gaps[cur[2]].append(g)
    print("| kernel | launches | median added us | median gap before us (< 0: overlap) |")
    print("|---|---:|---:|---:|")
    for name in sorted(added, key=lambda n: -sum(added[n])):
        print(f"| {name} | {len(added[name])} | {np.median(added[name]) / 1e3:.2f} | "
              f"{np.median(gaps[name]) / 1e3:.2f} |")
    all_gaps = [g for v in gaps.values() for g in v]
    print(f"\nall: median gap {np.median(all_gaps) / 1e3:.2f} us, "
          f"idle share {sum(max(g, 0) for g in all_gaps) / (trace[-1][0] + trace[-1][1] - trace[0][0]):.1%}")
    _step_positions(trace)


def _step_positions(trace):
    """Per position within a decode step (steps begin with the embedding lookup), the
    median time that position adds: which GEMV of the step (o, down, head) costs what."""
    starts = [i for i, (_, _, name) in enumerate(trace) if name.startswith("embed_kernel")]
    steps = [trace[a:b] for a, b in zip(starts, starts[1:])]
    if not steps:
        return
    length = collections.Counter(len(s) for s in steps).most_common(1)[0][0]
    steps = [s for s in steps if len(s) == length and [k[2] for k in s] == [k[2] for k in steps[0]]]
    if not steps:
        return
    print(f"\n{len(steps)} steps of {length} kernels; per position, median over steps "
          f"(a step: {np.median([s[-1][0] + s[-1][1] - s[0][0] for s in steps]) / 1e3:.1f} us from the "
          "embedding's start to the last kernel's end)\n")
    print("| # | kernel | added us | gap before us | duration us |")
    print("|---:|---|---:|---:|---:|")
    for i in range(1, length):
        added, gap = zip(*(_added_and_gap(s[i - 1], s[i]) for s in steps))
        print(f"| {i} | {steps[0][i][2]} | {np.median(added) / 1e3:.2f} | {np.median(gap) / 1e3:.2f} | "
              f"{np.median([s[i][1] for s in steps]) / 1e3:.2f} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("path")
    r.add_argument("--what", choices=("decode", "batch", "prefill"), required=True)
    r.add_argument("--device", default="cuda")
    r.add_argument("--trace", help="record with PyTorch's profiler into this Chrome trace (.json)")
    s = sub.add_parser("summarize")
    s.add_argument("csv")
    s.add_argument("--what", choices=("decode", "batch", "prefill"), required=True)
    s.add_argument("--tokens", type=float, default=1.0)
    t = sub.add_parser("timeline")
    t.add_argument("csv")
    args = p.parse_args(argv)
    return {"run": cmd_run, "summarize": cmd_summarize, "timeline": cmd_timeline}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())

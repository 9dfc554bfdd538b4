"""Decode speed of two library builds on the same models, measured alternately.

  python3 tools/gpu/ab.py --a DIR_A --b DIR_B MODEL... [--rounds 3] [--depths 8,16] [--out JSON]

DIR_A and DIR_B each hold libtinyloop.so (and cuda/libtinyloop_cuda.so). Each round
measures every model with A, then with B, each in a fresh process (a process loads
one library), so drift of the machine between runs falls on both builds alike; the
report is the median over rounds of greedy decode tokens/s (128-token prompt, 256 new
tokens, as tools/gpu/bench.py) and whether B decodes the same tokens as A. With
--depths, every depth is measured too, and the time per token is split into a part per
loop iteration (the slope between the first and last depth) and a fixed part (the
rest of the step: prelude, coda, head, sampling, and the host's turnaround).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# one process per build and model; the workload is tools/gpu/bench.py's decode
CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[4])
import tinyloop
from bench import NEW_TOKENS, PROMPT_TOKENS, _tokens
path, device, depths = sys.argv[1], sys.argv[2], [int(d) for d in sys.argv[3].split(",") if d]
out = {}
with tinyloop.Model(path, device=device) as model:
    prompt = _tokens(PROMPT_TOKENS, model.info.vocab_size, 7)
    for depth in [None] + depths:
        opts = {"depth": depth} if depth else {}
        model.generate(prompt, max_tokens=16, temperature=0.0, eos=False, **opts)   # warm-up, graphs captured
        best, tokens = 0.0, None
        for _ in range(2):
            res = model.generate(prompt, max_tokens=NEW_TOKENS, temperature=0.0, eos=False, **opts)
            best, tokens = max(best, res.decode_tokens_per_s), list(res.tokens)
        out[str(depth or "default")] = {"tok_s": best, "tokens": tokens}
print(json.dumps(out))
"""


def measure(lib_dir, model, device, depths):
    env = dict(os.environ, TINYLOOP_LIBRARY=os.path.join(lib_dir, "libtinyloop.so"))
    proc = subprocess.run([sys.executable, "-c", CHILD, model, device, ",".join(map(str, depths)), HERE],
                          env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode:
        raise RuntimeError(f"{lib_dir} on {model}: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--a", required=True)
    ap.add_argument("--b", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--depths", default="", help="comma-separated loop depths to measure too")
    ap.add_argument("--out")
    args = ap.parse_args()
    depths = [int(d) for d in args.depths.split(",") if d]
    keys = ["default"] + [str(d) for d in depths]
    runs = {m: {k: {"a": [], "b": [], "same_tokens": True} for k in keys} for m in args.models}
    for _ in range(args.rounds):
        for m in args.models:
            a = measure(args.a, m, args.device, depths)
            b = measure(args.b, m, args.device, depths)
            for k in keys:
                r = runs[m][k]
                r["a"].append(a[k]["tok_s"])
                r["b"].append(b[k]["tok_s"])
                r["same_tokens"] &= a[k]["tokens"] == b[k]["tokens"]
    print("| model | depth | A tok/s | B tok/s | B / A | same tokens |")
    print("|---|---|---:|---:|---:|---|")
    for m, per_depth in runs.items():
        for k, r in per_depth.items():
            r["median_a"], r["median_b"] = statistics.median(r["a"]), statistics.median(r["b"])
            print(f"| {os.path.basename(m)} | {k} | {r['median_a']:.1f} | {r['median_b']:.1f} | "
                  f"{r['median_b'] / r['median_a']:.3f} | {r['same_tokens']} |")
    if len(depths) >= 2:
        lo, hi = str(depths[0]), str(depths[-1])
        print(f"\n| model | build | us per token at depth {lo} | per loop iteration | fixed |")
        print("|---|---|---:|---:|---:|")
        for m, per_depth in runs.items():
            for build in ("a", "b"):
                t_lo = 1e6 / per_depth[lo][f"median_{build}"]
                t_hi = 1e6 / per_depth[hi][f"median_{build}"]
                slope = (t_hi - t_lo) / (depths[-1] - depths[0])
                print(f"| {os.path.basename(m)} | {build.upper()} | {t_lo:.1f} | {slope:.1f} | "
                      f"{t_lo - slope * depths[0]:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"a": args.a, "b": args.b, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()

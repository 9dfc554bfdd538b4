"""Merges the step records of tools/gpu_check into OUT/gpu_check.json and OUT/gpu_check.md.

Reads OUT/steps/*.json (one per step: rc, seconds, timed_out; *.result.json: benchmark
numbers) and OUT/pytest.xml (test counts and the first failures)."""

import argparse
import datetime
import glob
import json
import os
import xml.etree.ElementTree as ET

GIB = 1024 ** 3


def _load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _pytest_summary(path):
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    summary = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in root.iter("testcase"):
        for tag in ("failure", "error"):
            node = case.find(tag)
            if node is not None:
                failed.append({"test": f"{case.get('classname')}::{case.get('name')}",
                               "message": (node.get("message") or "")[:400]})
    summary["failed"] = failed[:30]
    return summary


def _floor(bench, bandwidth):
    if not bandwidth or "bytes_per_token" not in bench:
        return {}
    floor = bandwidth / bench["bytes_per_token"]
    floor_l2 = bandwidth / bench["bytes_per_token_core_in_l2"]
    out = {"floor_tok_s": floor, "floor_tok_s_core_in_l2": floor_l2}
    if bench.get("decode_tok_s"):
        out["fraction_of_floor"] = bench["decode_tok_s"] / floor
        out["fraction_of_floor_core_in_l2"] = bench["decode_tok_s"] / floor_l2
    return out


def _batch_peer_lines(pair, num):
    """The batch-peer step: TinyLoop's generate_batch beside the compiled PyTorch peer."""
    ours, peer = pair.get("tinyloop") or {}, pair.get("torch") or {}
    if not ours and not peer:
        return []
    rows = {r["batch"]: [r, {}] for r in ours.get("rows", [])}
    for r in peer.get("rows", []):
        rows.setdefault(r["batch"], [{}, {}])[1] = r
    lines = ["", f"batched decoding, loop-1b q4 g64 ({ours.get('kv_dtype', '?')} KV; generate_batch, "
                 f"{ours.get('prompt_tokens', '?')}-token prompts, {ours.get('new_tokens', '?')} new tokens, decode "
                 f"steps only) beside {peer.get('peer', 'the PyTorch peer')} (torch {peer.get('torch', '?')}):", "",
             "| batch | TinyLoop tok/s | PyTorch peer tok/s | TinyLoop / peer |", "|---:|---:|---:|---:|"]
    for b, (a, p) in sorted(rows.items()):
        ratio = a["decode_tok_s"] / p["decode_tok_s"] if a.get("decode_tok_s") and p.get("decode_tok_s") else None
        lines.append(f"| {b} | {num(a.get('decode_tok_s'))} | {num(p.get('decode_tok_s'))} | {num(ratio, '{:.2f}')} |"
                     + (f" error: {a['error'][:120]}" if a.get("error") else "")
                     + (f" peer error: {p['error'][:120]}" if p.get("error") else ""))
    if ours.get("error"):
        lines.append(f"TinyLoop error: {ours['error'][:300]}")
    return lines


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--archs", default="")
    p.add_argument("--device", default="")
    p.add_argument("--elapsed", type=int, default=0)
    args = p.parse_args()
    steps_dir = os.path.join(args.out, "steps")
    steps = {}
    for path in sorted(glob.glob(os.path.join(steps_dir, "*.json")), key=os.path.getmtime):
        if not path.endswith(".result.json"):
            record = _load(path)
            if record:
                steps[record["name"]] = record
    # the HF peer of loop-1b (peer.result.json) and of other models (peer-TAG.result.json)
    peers = {}
    for path in sorted(glob.glob(os.path.join(steps_dir, "peer*.result.json")), key=lambda p: "peer." not in p):
        name = os.path.basename(path)[:-len(".result.json")]
        peers["loop-1b" if name == "peer" else name[len("peer-"):]] = _load(path) or {}
    peer = peers.get("loop-1b", {})
    bandwidth = next((p["copy_bandwidth_Bps"] for p in peers.values() if p.get("copy_bandwidth_Bps")), None)
    benches = {}
    for path in sorted(glob.glob(os.path.join(steps_dir, "bench-*.result.json"))):
        tag = os.path.basename(path)[len("bench-"):-len(".result.json")]
        bench = _load(path) or {}
        bench.update(_floor(bench, bandwidth))
        benches[tag] = bench
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "tools/gpu_check", "device": args.device, "gpu_archs": args.archs,
        "elapsed_s": args.elapsed, "steps": steps,
        "pytest": _pytest_summary(os.path.join(args.out, "pytest.xml")),
        "tinyloop": benches, "peer": peer, "peers": peers,
        "speculative": _load(os.path.join(steps_dir, "speculative.result.json")),
        "batch": _load(os.path.join(steps_dir, "batch.result.json")),
        "batch_peer": {"tinyloop": _load(os.path.join(steps_dir, "batch-peer-tinyloop.result.json")),
                       "torch": _load(os.path.join(steps_dir, "batch-peer-torch.result.json"))},
    }
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)

    lines = [f"# gpu_check {report['date']} ({args.elapsed} s, device {args.device}, archs {args.archs})", "",
             "| step | rc | seconds |", "|---|---:|---:|"]
    for name, s in steps.items():
        lines.append(f"| {name} | {s['rc']}{' (timed out)' if s.get('timed_out') else ''} | {s['seconds']} |")
    t = report["pytest"]
    if t:
        lines += ["", f"pytest: {t['tests']} tests, {t['failures']} failures, {t['errors']} errors, "
                      f"{t['skipped']} skipped"]
        lines += [f"- FAILED {x['test']}: {x['message'][:160]}" for x in t["failed"][:10]]

    def num(v, fmt="{:.1f}"):
        return fmt.format(v) if isinstance(v, (int, float)) else "-"

    lines += ["", "| loop-1b | decode tok/s | sampled | without graphs | without PDL | without dp4a | prefill 512 ms | "
              "without tensor cores | peak device GiB | floor tok/s (L=8 / core in L2) | of floor |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def variant(b, key):
        same = b.get(f"tokens_match_{key}", b.get("graph_tokens_match_eager") if key == "eager" else None)
        return num(b.get(f"decode_tok_s_{key}")) + ("" if same in (None, True) else " (tokens differ!)")

    for tag, b in benches.items():
        lines.append(f"| tinyloop {tag} | {num(b.get('decode_tok_s'))} | {num(b.get('decode_tok_s_sampled'))} | "
                     f"{variant(b, 'eager')} | "
                     f"{variant(b, 'no_pdl')} | {variant(b, 'no_dp4a')} | {num(b.get('prefill_512_ms'))} | {num(b.get('prefill_512_ms_no_tc'))} | "
                     f"{num(b.get('peak_device_bytes', 0) / GIB if b.get('peak_device_bytes') else None, '{:.2f}')} | "
                     f"{num(b.get('floor_tok_s'), '{:.0f}')} / {num(b.get('floor_tok_s_core_in_l2'), '{:.0f}')} | "
                     f"{num(b.get('fraction_of_floor'), '{:.1%}')} |"
                     + (f" error: {b['error'][:120]}" if b.get("error") else ""))
    for model, p in peers.items():
        peak = p.get("peak_device_bytes")
        label = "" if model == "loop-1b" else f" ({model})"
        for mode in ("eager", "static_cache"):
            lines.append(f"| HF bf16 {mode}{label} | {num(p.get(f'decode_tok_s_{mode}'))} | | | | "
                         f"| {num(p.get('prefill_512_ms'))} | | {num(peak / GIB if peak else None, '{:.2f}')} | | |"
                         + (f" error: {p[f'error_{mode}'][:120]}" if p.get(f"error_{mode}") else ""))
    if bandwidth:
        lines += ["", f"device copy bandwidth (read + write): {bandwidth / 1e12:.2f} TB/s; "
                      f"L2 {next(iter(peers.values())).get('l2_bytes', 0) / 2**20:.0f} MiB"]
    spec = report["speculative"]
    if spec:
        lines += ["", f"self-speculative decoding of {os.path.basename(spec['model'])}, depth {spec['depth']}, "
                      f"on {spec['device']} (tools/bench/speculative.py, medians of {spec['repeat']} rounds):", "",
                  "| decoding | decode tok/s | vs plain | drafts kept | tokens per full pass |",
                  "|---|---:|---:|---:|---:|"]
        for row in spec["rows"]:
            lines.append(f"| {row['config']} | {num(row['decode_tokens_per_s'])} | {num(row['speedup'], '{:.3f}')} | "
                         f"{num(row['acceptance'], '{:.2f}')} | {num(row['tokens_per_full_pass'], '{:.2f}')} |")
    batch = report["batch"]
    if batch:
        lines += ["", f"batched decoding on {batch['device']} (tools/bench/batch.py: generate_batch against "
                      f"the same {batch['prompt_tokens']}-token prompts one after another, {batch['new_tokens']} "
                      f"greedy tokens each, medians of {batch['repeat']} rounds):", "",
                  "| prompts | batched tok/s | one after another tok/s | speed-up | decode steps speed-up |",
                  "|---:|---:|---:|---:|---:|"]
        for row in batch["rows"]:
            lines.append(f"| {row['batch']} | {num(row['batched_tok_s'])} | {num(row['alone_tok_s'])} | "
                         f"{num(row['speedup'], '{:.2f}')} | {num(row['decode_speedup'], '{:.2f}')} |")
    lines += _batch_peer_lines(report["batch_peer"], num)
    for model, p in peers.items():
        if p.get("error"):
            lines += ["", f"peer error ({model}): {p['error'][:300]}"]
    with open(os.path.join(args.out, "gpu_check.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

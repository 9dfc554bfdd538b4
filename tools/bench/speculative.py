#!/usr/bin/env python3
"""Self-speculative decoding against plain decoding of the same model, in one run.

For each prompt, plain decoding (the peer: the same runtime, one full-depth step per
token) and speculative decoding with each (draft_depth, n_draft) pair run in alternating
rounds; the medians of decode tokens/s are reported with the share of drafts kept and the
tokens per verification pass (the configs' order rotates from round to round). Greedy (the
default), every run is also checked to give the same tokens as the others; with
--temperature > 0 (the library's other sampling defaults: top-k 40, top-p 0.95, min-p
0.05; seed = the round) the runs sample, and that their tokens follow plain sampling's
distribution is the tests' job (tests/lib/test_speculative.py). Beside them: the time of one
decode step at each draft depth and at the full depth (a context stepping one token at a
time), which bounds what a draft can save.

    python tools/bench/speculative.py --threads 2 --repeat 5 --drafts 1:3,2:3,1:2 --json out.json
    python tools/bench/speculative.py --device cuda --repeat 5 --drafts 1:1,1:2 --json gpu.json
    python tools/bench/speculative.py --model m.tinyloop --drafts 1:2,1:2:8192 --json vocab.json
    python tools/bench/speculative.py --drafts 2:2,2:6 --draft-p-min 0,0.3,0.5
    python tools/bench/speculative.py --drafts 2:2 --trees 2:3x1x1,2:4x2x1:12   # tree speculation
"""
import argparse
import contextlib
import json
import platform
import statistics
import time

import tinyloop
from tinyloop.default_model import default_model_path

PROMPTS = [
    "The state of our union is strong, and tonight I want to speak about",
    "In the years after the war, the nation turned its attention to",
    "Once upon a time, in a small village by the sea, there lived",
    "The committee reported that the new law would",
]


def step_seconds(model, prompt_ids, depth, steps):
    """Median seconds of one single-token append at `depth` after the prompt."""
    times = []
    steps = min(steps, model.info.max_seq_len - len(prompt_ids))
    with model.context() as ctx:
        ctx.append(prompt_ids, depth=depth)
        token = prompt_ids[-1]
        for _ in range(steps):
            t0 = time.perf_counter()
            ctx.append([token], depth=depth)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def parse_draft(item: str) -> tuple:
    """DRAFT_DEPTH:N_DRAFT[:DRAFT_VOCAB] -> (depth, n, vocab); vocab as the load option
    draft_vocab: 0 = the whole vocabulary, -1 (the default) = the file's choice."""
    values = [int(v) for v in item.split(":")]
    if len(values) not in (2, 3):
        raise SystemExit(f"--drafts item {item!r}: expected DRAFT_DEPTH:N_DRAFT[:DRAFT_VOCAB]")
    return tuple(values) if len(values) == 3 else (*values, -1)


def parse_tree(item: str) -> tuple:
    """DRAFT_DEPTH:W1xW2x...[:BUDGET] -> (depth, widths, budget); budget 0 = the shape's size."""
    parts = item.split(":")
    if len(parts) not in (2, 3):
        raise SystemExit(f"--trees item {item!r}: expected DRAFT_DEPTH:W1xW2x...[:BUDGET]")
    return int(parts[0]), tuple(int(w) for w in parts[1].split("x")), int(parts[2]) if len(parts) == 3 else 0


def tree_name(depth: int, widths: tuple, budget: int, model) -> str:
    vocab = model.info.draft_vocab
    return (("the file's draft depth" if depth == -1 else f"draft depth {depth}") + ", tree "
            + "x".join(map(str, widths)) + (f" budget {budget}" if budget else "")
            + (f", {vocab} tokens" if vocab else ""))


def draft_name(depth: int, n: int, model, p_min: float) -> str:
    vocab = model.info.draft_vocab
    return (("the file's draft depth" if depth == -1 else f"draft depth {depth}")
            + (", the file's n_draft" if n == 0 else f", {n} drafts")
            + (f", {vocab} tokens" if vocab else "") + (f", p_min {p_min:g}" if p_min else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help=".tinyloop file (default: the packaged model)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (the CPU device)")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--depth", type=int, default=0, help="generation depth (0: the model's default)")
    ap.add_argument("--drafts", default="1:3,2:3",
                    help="comma list of DRAFT_DEPTH:N_DRAFT[:DRAFT_VOCAB] (the draft_vocab load "
                         "option: drafts score the N most frequent tokens; 0 = every token; "
                         "-1, the default, = the file's choice)")
    ap.add_argument("--draft-p-min", default="0",
                    help="comma list: each draft config runs with each draft_p_min")
    ap.add_argument("--trees", default="",
                    help="comma list of DRAFT_DEPTH:W1xW2x...[:BUDGET]: tree speculation, the "
                         "tree's branching per level and its node budget")
    ap.add_argument("--repeat", type=int, default=5, help="alternating rounds")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (tokens checked equal)")
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)
    drafts = [parse_draft(item) for item in args.drafts.split(",") if item]
    p_mins = [float(v) for v in args.draft_p_min.split(",")]
    trees = [parse_tree(item) for item in args.trees.split(",") if item]
    path = args.model or str(default_model_path())

    with contextlib.ExitStack() as stack:
        # the draft vocabulary is a load option: one model per size asked for
        models = {v: stack.enter_context(tinyloop.Model(path, device=args.device, threads=args.threads,
                                                        draft_vocab=v))
                  for v in sorted({-1} | {v for _, _, v in drafts})}
        model = models[-1]
        depth = args.depth or model.info.default_depth
        options = dict(max_tokens=args.new_tokens, depth=depth, temperature=args.temperature, eos=False)
        prompts = [model.tokenizer.encode(p) for p in PROMPTS]
        configs = [("plain", model, {})]
        for d, n, v in drafts:
            for p_min in p_mins:
                name = draft_name(d, n, models[v], p_min)
                if name not in {c[0] for c in configs}:   # two sizes may resolve to the same one
                    configs.append((name, models[v], dict(draft_depth=d, n_draft=n, draft_p_min=p_min)))
        for d, widths, budget in trees:
            for p_min in p_mins:
                configs.append((tree_name(d, widths, budget, model) + (f", p_min {p_min:g}" if p_min else ""), model,
                                dict(draft_depth=d, tree=widths, tree_budget=budget, draft_p_min=p_min)))
        speed = {name: [] for name, _, _ in configs}
        kept = {name: [0, 0, 0, 0] for name, _, _ in configs}  # accepted, drafted, tokens, rounds
        for round_index in range(args.repeat):
            # each round starts with another config, so no config always runs first
            shift = round_index % len(configs)
            order = configs[shift:] + configs[:shift]
            for ids in prompts:
                reference = None
                for name, config_model, extra in order:
                    r = config_model.generate(ids, **options, **extra, seed=round_index)
                    if args.temperature == 0:   # greedy: every config gives the same tokens
                        reference = r.tokens if reference is None else reference
                        if r.tokens != reference:
                            raise SystemExit(f"{name}: tokens differ from the other configs'")
                    speed[name].append(r.decode_tokens_per_s)
                    k = kept[name]
                    k[0] += r.accepted_tokens
                    k[1] += r.drafted_tokens
                    k[2] += len(r.tokens) - 1          # tokens after the prompt's own
                    k[3] += len(r.tokens) - 1 - r.accepted_tokens  # full-depth passes
        device_name = model.info.device_name
        steps = {d: step_seconds(model, prompts[0], d, 40)
                 for d in sorted({d for d, _, _ in drafts + trees if d > 0} | {depth})}

    rows = []
    plain = statistics.median(speed["plain"])
    for name, _, _ in configs:
        acc, drafted, tokens, passes = kept[name]
        tps = statistics.median(speed[name])
        rows.append(dict(config=name, decode_tokens_per_s=round(tps, 1),
                         speedup=round(tps / plain, 3),
                         acceptance=round(acc / drafted, 3) if drafted else None,
                         tokens_per_full_pass=round(tokens / passes, 2) if passes else None))
    report = dict(model=path, device=device_name, depth=depth, threads=args.threads, new_tokens=args.new_tokens,
                  temperature=args.temperature,
                  prompts=len(PROMPTS), repeat=args.repeat, machine=platform.processor() or platform.machine(),
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  step_ms={str(d): round(s * 1e3, 3) for d, s in steps.items()}, rows=rows)
    print(f"{'config':<56} {'tok/s':>8} {'speedup':>8} {'kept':>6} {'tok/pass':>9}")
    for row in rows:
        acc = "" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
        tpp = "" if row["tokens_per_full_pass"] is None else f"{row['tokens_per_full_pass']:.2f}"
        print(f"{row['config']:<56} {row['decode_tokens_per_s']:>8.1f} {row['speedup']:>8.3f} {acc:>6} {tpp:>9}")
    print("one decode step (ms): " + ", ".join(f"depth {d}: {ms}" for d, ms in report["step_ms"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

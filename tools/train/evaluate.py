"""Held-out quality of an exported student, measured with the TinyLoop runtime on CPU.

Per loop depth: perplexity on the held-out SOTU 2001+ tokens (.traindata/tokens/eval_sotu.u16,
scored in windows of --ctx tokens, each from a fresh context), the ratio to the teacher's
perplexity on the same tokens (a converted teacher .tinyloop), and the greedy draft
agreement: the share of positions where the argmax next token at depth d equals the one at
the default depth (token-by-token decode through a context, as speculative decoding sees it),
and, for a file with a draft vocabulary (vocab.frequency), the same for drafts that pick
only among its tokens, as the runtime's drafts do.
Writes JSON and prints a markdown table for docs/models.md; --by-document also scores each
address (in the order of eval_sotu.txt, 2001 first) at the default depth, from the same pass.

  python3 tools/train/evaluate.py --model student.tinyloop --teacher-model teacher.tinyloop \\
      --json eval.json
(needs the built runtime: PYTHONPATH=python:plugins, TINYLOOP_LIBRARY=.../libtinyloop.so;
16384 tokens x 8 depths take ~10 min on 2 busy cores)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))
from tinyloop import Model  # noqa: E402
from tinyloop.fileformat.tinyloop_file import read_file  # noqa: E402


def heldout_tokens(path: Path, n: int) -> np.ndarray:
    if not path.exists():
        raise SystemExit(f"{path} is missing: run tools/train/data.py first")
    tokens = np.fromfile(path, dtype=np.uint16).astype(np.int32)
    return tokens[:n] if n > 0 else tokens


def greedy_logits(model: Model, tokens: np.ndarray, depth: int, prefix: int) -> np.ndarray:
    """Next-token logits after each of tokens[prefix-1:], decoding one token at a time."""
    out = []
    with model.context(max_seq_len=len(tokens) + 1) as ctx:
        out.append(ctx.append(tokens[:prefix], depth))
        for t in tokens[prefix:]:
            out.append(ctx.append(t[None], depth))
    return np.stack(out)


def draft_vocabulary(path: str, n: int) -> np.ndarray | None:
    """The tokens a draft vocabulary of n scores (the runtime's rule: the file's
    vocab.frequency, highest first, ties to the lower id), ascending; None without one."""
    with read_file(path) as f:
        if n <= 0 or "vocab.frequency" not in f.tensors:
            return None
        frequency = f.tensor("vocab.frequency").astype(np.float64)
    return np.sort(np.lexsort((np.arange(len(frequency)), -frequency))[:n])


def draft_agreement(model: Model, tokens: np.ndarray, depths: list, default_depth: int,
                    windows: int, prefix: int, span: int, among: np.ndarray | None = None) -> tuple:
    """Agreement per draft depth; with `among` (a draft vocabulary) also the agreement of
    drafts that pick only among those tokens."""
    starts = np.linspace(0, len(tokens) - prefix - span, windows).astype(int)
    agree = {d: 0 for d in depths}
    agree_among = {d: 0 for d in depths}
    total = 0
    for s in starts:
        piece = tokens[s:s + prefix + span]
        ref = greedy_logits(model, piece, default_depth, prefix).argmax(axis=1)
        for d in depths:
            logits = greedy_logits(model, piece, d, prefix)
            agree[d] += int((logits.argmax(axis=1) == ref).sum())
            if among is not None:
                agree_among[d] += int((among[logits[:, among].argmax(axis=1)] == ref).sum())
        total += len(ref)
    return ({d: a / total for d, a in agree.items()},
            {d: a / total for d, a in agree_among.items()} if among is not None else None)


def document_spans(tokens: np.ndarray, is_break: np.ndarray) -> list:
    """(start, end) of each address. data.py joins them with a blank line and each address is
    one line, so the addresses are what lies between runs of newline tokens (`is_break`: how
    the blank line encodes depends on its neighbours); a span ends after the run closing it."""
    ends = np.flatnonzero(is_break[:-1] & ~is_break[1:]) + 1
    cuts = [0, *ends.tolist(), len(tokens)]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b - a > 1]


def newline_tokens(tokens: np.ndarray, tokenizer) -> np.ndarray:
    """Whether each token decodes to newlines only."""
    texts = {int(i): tokenizer.decode([int(i)], skip_special_tokens=False) for i in np.unique(tokens)}
    return np.isin(tokens, [i for i, text in texts.items() if text and not text.strip("\n")])


def perplexity(logprobs: np.ndarray) -> float:
    return float(np.exp(-np.mean(logprobs, dtype=np.float64)))


def by_document(logprobs: np.ndarray, spans: list) -> list:
    """Perplexity of each span's tokens (log-probs predict tokens[1:], hence the shift)."""
    return [perplexity(logprobs[max(a - 1, 0):b - 1]) for a, b in spans]


def markdown(res: dict) -> str:
    depths = list(res["ppl"])
    head = "| depth | " + " | ".join(depths) + (" | teacher |" if res.get("teacher_ppl") else " |")
    lines = [head, "|---|" + "---|" * (len(depths) + (1 if res.get("teacher_ppl") else 0))]
    lines.append("| held-out SOTU 2001+ perplexity | " + " | ".join(f"{res['ppl'][d]:.1f}" for d in depths)
                 + (f" | {res['teacher_ppl']:.1f} |" if res.get("teacher_ppl") else " |"))
    if res.get("teacher_ppl"):
        lines.append("| ratio to teacher | " + " | ".join(f"{res['ppl'][d] / res['teacher_ppl']:.2f}"
                                                        for d in depths) + " | 1.00 |")
    rows = [("greedy agreement with the default depth", res.get("agreement")),
            (f"the same, drafts among the {res.get('draft_vocab')} most frequent tokens",
             res.get("agreement_draft_vocab"))]
    for label, agreement in rows:
        if agreement:
            lines.append(f"| {label} | "
                         + " | ".join(f"{agreement[d]:.2f}" if d in agreement else
                                      ("1" if int(d) == res["default_depth"] else "") for d in depths)
                         + (" | |" if res.get("teacher_ppl") else " |"))
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="student .tinyloop")
    ap.add_argument("--teacher-model", help="teacher converted to .tinyloop (for the ratio)")
    ap.add_argument("--tokens", default=str(REPO / ".traindata" / "tokens" / "eval_sotu.u16"))
    ap.add_argument("--n-tokens", type=int, default=16384, help="held-out tokens scored (0: all)")
    ap.add_argument("--ctx", type=int, default=1024, help="scoring window")
    ap.add_argument("--depths", default="", help="comma list (default: 1..max depth)")
    ap.add_argument("--agree-windows", type=int, default=4)
    ap.add_argument("--agree-prefix", type=int, default=64)
    ap.add_argument("--agree-span", type=int, default=128, help="decoded positions per window")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--by-document", action="store_true",
                    help="also the default depth's (and the teacher's) perplexity per address")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    tokens = heldout_tokens(Path(args.tokens), args.n_tokens)
    model = Model(args.model, threads=args.threads)
    info = model.info
    default_depth = info.default_depth
    depths = [int(d) for d in args.depths.split(",")] if args.depths else list(range(1, info.max_depth + 1))
    if args.by_document and default_depth not in depths:
        raise SystemExit(f"--by-document scores the default depth ({default_depth}): add it to --depths")
    res = {"model": Path(args.model).name, "tokens": len(tokens), "ctx": args.ctx,
           "default_depth": default_depth, "ppl": {}}
    spans = document_spans(tokens, newline_tokens(tokens, model.tokenizer)) if args.by_document else None
    for d in depths:
        t0 = time.time()
        logprobs = model.score_windows(tokens, depth=d, ctx=args.ctx)
        res["ppl"][str(d)] = perplexity(logprobs)
        if spans and d == default_depth:
            res["documents"] = [{"start": a, "end": b, "ppl": p} for (a, b), p in zip(spans, by_document(logprobs, spans))]
        print(f"depth {d}: perplexity {res['ppl'][str(d)]:.2f} ({time.time() - t0:.0f} s)", flush=True)
    if args.teacher_model:
        with Model(args.teacher_model, threads=args.threads) as teacher:
            logprobs = teacher.score_windows(tokens, ctx=args.ctx)
        res["teacher_ppl"] = perplexity(logprobs)
        if res.get("documents"):
            for doc, p in zip(res["documents"], by_document(logprobs, spans)):
                doc["teacher_ppl"] = p
        print(f"teacher: perplexity {res['teacher_ppl']:.2f}", flush=True)
    if args.agree_windows > 0:
        drafts = [d for d in depths if d < default_depth]
        among = draft_vocabulary(args.model, info.draft_vocab)
        agreement, agreement_among = draft_agreement(model, tokens, drafts, default_depth, args.agree_windows,
                                                     args.agree_prefix, args.agree_span, among)
        res["agreement"] = {str(d): a for d, a in agreement.items()}
        if agreement_among:
            res["draft_vocab"] = info.draft_vocab
            res["agreement_draft_vocab"] = {str(d): a for d, a in agreement_among.items()}
        res["agreement_positions"] = args.agree_windows * (args.agree_span + 1)
    if str(default_depth) in res["ppl"]:
        res["depth1_over_default"] = res["ppl"].get("1", math.nan) / res["ppl"][str(default_depth)]
        if res.get("teacher_ppl"):
            res["default_over_teacher"] = res["ppl"][str(default_depth)] / res["teacher_ppl"]
    model.close()
    table = markdown(res)
    print("\n" + table)
    for i, doc in enumerate(res.get("documents", [])):
        ratio = f", ratio {doc['ppl'] / doc['teacher_ppl']:.2f}" if "teacher_ppl" in doc else ""
        print(f"address {i + 1}: {doc['end'] - doc['start']} tokens, perplexity {doc['ppl']:.2f}{ratio}")
    if args.json:
        Path(args.json).write_text(json.dumps({**res, "markdown": table}, indent=1) + "\n")


if __name__ == "__main__":
    main()

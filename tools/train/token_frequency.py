"""Copy a .tinyloop with the token frequencies of its training text: the draft vocabulary.

Self-speculative decoding drafts at a shallow loop depth and scores only the N most
frequent tokens of the training text, so a draft's output head reads N embedding rows, not
vocab_size (by default 8192 of SmolLM2's 49152). The runtime ranks tokens by the f32
tensor `vocab.frequency` (count / total count per token) and takes N from the int metadata
`draft.vocab_size`; this writes both, replacing any already there, and copies every other
tensor's bytes and all other metadata as they are. --draft-depth / --n-draft also write the
drafting the file recommends (draft.depth, draft.n_draft: what generation's draft_depth -1
and n_draft 0 take), measured with tools/bench/speculative.py.

  python3 tools/train/token_frequency.py IN.tinyloop OUT.tinyloop \\
      --tokens .traindata/tokens/train.u16 [--tokens MORE.u16] [--dtype u16] [--draft-vocab 8192] \\
      [--draft-depth 2 --n-draft 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
from tinyloop.errors import FormatError  # noqa: E402
from tinyloop.fileformat.tinyloop_file import copy_file, read_file  # noqa: E402

TOKEN_DTYPES = {"u16": "<u2", "u32": "<u4"}   # flat little-endian arrays, as data.py writes


def count_tokens(paths, vocab_size: int, dtype: str = "u16") -> np.ndarray:
    """Occurrences of each token id 0..vocab_size-1 over the token files (int64)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for path in paths:
        ids = np.fromfile(path, dtype=TOKEN_DTYPES[dtype])
        if ids.nbytes != Path(path).stat().st_size:   # fromfile drops a partial last id
            raise SystemExit(f"{path}: size is not a whole number of {dtype} token ids")
        bad = ids >= vocab_size
        if bad.any():
            at = int(np.argmax(bad))
            raise SystemExit(f"{path}: token id {int(ids[at])} at position {at} is outside the "
                             f"model's vocabulary 0..{vocab_size - 1} (wrong --dtype or model?)")
        counts += np.bincount(ids, minlength=vocab_size)
    return counts


def write_frequencies(src, dst, token_paths, dtype: str = "u16", draft_vocab: int = 8192,
                      draft_depth: int = 0, n_draft: int = 0) -> str:
    """Write dst = src with vocab.frequency and draft.vocab_size (and draft.depth /
    draft.n_draft when given: the drafting the file recommends); returns the summary line."""
    if draft_vocab < 0:
        raise SystemExit(f"--draft-vocab must be >= 0, got {draft_vocab}")
    if draft_depth < 0 or not 0 <= n_draft <= 32:
        raise SystemExit(f"--draft-depth must be >= 0 and --n-draft in 0..32, got {draft_depth}, {n_draft}")
    with read_file(src) as f:
        vocab_size, max_depth = f.dims["vocab_size"], f.dims["max_depth"]
    if draft_depth > max_depth:
        raise SystemExit(f"--draft-depth {draft_depth} is deeper than the file's max_depth {max_depth}")
    counts = count_tokens(token_paths, vocab_size, dtype)
    total = int(counts.sum())
    if total == 0:
        raise SystemExit("the token files hold no tokens")
    n = min(draft_vocab, vocab_size)
    frequency = (counts / total).astype(np.float32)
    try:
        advice = {k: v for k, v in (("draft.depth", draft_depth), ("draft.n_draft", n_draft)) if v}
        copy_file(src, dst, metadata={"draft.vocab_size": n, **advice},
                  tensors={"vocab.frequency": frequency})
    except FormatError as e:     # OUT == IN, a corrupt IN: a message, not a traceback
        raise SystemExit(str(e)) from None
    covered = int(np.sort(counts)[::-1][:n].sum())
    return (f"{total} tokens counted, {np.count_nonzero(counts)} of {vocab_size} distinct "
            f"tokens seen; the top {n} cover {covered / total:.2%} of them")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--tokens", action="append", required=True, help="token file (repeatable)")
    ap.add_argument("--dtype", choices=sorted(TOKEN_DTYPES), default="u16")
    ap.add_argument("--draft-vocab", type=int, default=8192,
                    help="draft.vocab_size, clipped to the model's vocab_size (default 8192)")
    ap.add_argument("--draft-depth", type=int, default=0,
                    help="draft.depth: the draft depth the file recommends (0: not written)")
    ap.add_argument("--n-draft", type=int, default=0,
                    help="draft.n_draft: the drafts per round it recommends (0: not written)")
    args = ap.parse_args(argv)
    print(f"wrote {args.dst}: " + write_frequencies(args.src, args.dst, args.tokens, args.dtype,
                                                    args.draft_vocab, args.draft_depth, args.n_draft))


if __name__ == "__main__":
    main()
